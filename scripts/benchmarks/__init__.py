"""``make bench``: every figure is a ratio of two sides measured in one run, interleaved.

Absolute images/s on a shared machine move with whatever else runs; the ratio of two sides
measured back to back (A, B, A, B, ...) mostly does not. ``stats`` holds the arithmetic,
``training`` the template-versus-bare-loop runs (P1, P3, logger), ``pipelines`` the data
paths (P2, P4), ``checkpoint_cost`` P5, ``report`` the bench.json/bench.md writers, and
``bare_loop`` the plain PyTorch loop the template is compared with.
"""
