"""The framework's own Hydra configs (``pkg://reprotrain.selfcheck.conf``).

A regular package (not a namespace one), so Hydra's importlib source can read it.
"""
