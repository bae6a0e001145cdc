"""Checkpoints: atomic writing, completeness checks and discovery."""
