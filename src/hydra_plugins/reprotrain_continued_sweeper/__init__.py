"""``hydra/sweeper=continued``: a killed grid or seed sweep continued in its own directory.

The framework's Hydra sweeper plugin for ``make resume RUN=<sweep dir>``; the decisions are
``reprotrain.tools.sweeps.continuation``.
"""
