"""reprotrain: same code, same lock, same config, same machine -> the same bits."""

__version__ = "0.1.0"
