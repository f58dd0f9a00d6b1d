"""User-facing errors.

Anything raised as ``ReprotrainError`` is a problem the user can fix (bad override, missing
data, mismatched checkpoint). Entry points print its message as one line and exit non-zero
instead of dumping a traceback; anything else is a bug and keeps its traceback.
"""


class ReprotrainError(Exception):
    """A user error: the message is one line that says what to do."""

    exit_code = 2


class DataMissingError(ReprotrainError):
    """The dataset is not on disk and could not be downloaded."""


class ResumeError(ReprotrainError):
    """A resume was refused; the run directory is left exactly as it was."""


class CheckpointError(ResumeError):
    """A checkpoint is corrupt, truncated, unsafe or does not match the run."""
