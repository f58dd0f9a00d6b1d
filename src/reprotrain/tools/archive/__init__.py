"""Packing a finished run (or a sweep) into one self-checking archive: manifest, source
snapshot, signature."""
