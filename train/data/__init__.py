"""Training data: records and chat templates, prompts, self-distillation, Magpie prompts, hidden states (features, cache), draft vocabulary."""
