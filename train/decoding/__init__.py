"""The speculative decoding loop (chains and trees), draft length, metrics, HF assisted generation."""
