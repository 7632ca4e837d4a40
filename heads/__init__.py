"""Drafters, their contract with the verification loop (base.py) and the --drafter kinds."""
