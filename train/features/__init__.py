"""The target's hidden states for feature-level drafters (EAGLE, Medusa): computed online or read from the offline cache (format, writer, reader, command)."""
