"""Resuming a run: what a resume point must match (guard), what it restores (audit)."""
