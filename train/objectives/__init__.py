"""What each recipe optimises, and where its drafter starts: distillation losses, EAGLE's training-time test unroll, Medusa's losses, draft-LM initialisation."""
