"""Checking the hashed dependency locks and the installed environment against them."""
