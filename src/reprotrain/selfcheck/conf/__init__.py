"""The framework's own Hydra configs (``pkg://reprotrain.selfcheck.conf``): a package, so importlib finds it."""
