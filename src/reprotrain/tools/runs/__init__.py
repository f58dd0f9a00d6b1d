"""Working with one run directory: read, resume, verify, evaluate, report, compare."""
