"""Summarising a sweep and comparing two sweeps statistically."""
