"""draftsmith.heads."""
