"""Training data the target writes itself: Magpie prompts and self-distilled answers (batched generation, resumable append-only output)."""
