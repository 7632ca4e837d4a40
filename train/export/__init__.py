"""Export of trained drafters to the layouts serving engines load (speculators, EAGLE, Medusa, HF)."""
