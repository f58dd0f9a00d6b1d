"""User-facing errors.

Anything raised as ``ReprotrainError`` is a problem the user can fix (bad override, missing
data, mismatched checkpoint). Entry points print its message as one line and exit non-zero
instead of dumping a traceback; anything else is a bug and keeps its traceback.
"""


def one_line(text: object) -> str:
    """Messages are one line by contract: the text's non-blank lines, stripped, joined by
    ``; `` (empty when there is none, so a caller can fall back to a name)."""
    parts = [p.strip() for p in str(text).strip().splitlines() if p.strip()]
    return "; ".join(parts)


class ReprotrainError(Exception):
    """A user error: the message is one line that says what to do."""

    exit_code = 2


class DataMissingError(ReprotrainError):
    """The dataset is not on disk and could not be downloaded."""


class ResumeError(ReprotrainError):
    """A resume was refused; the run directory is left exactly as it was."""


class CheckpointError(ResumeError):
    """A checkpoint is corrupt, truncated, unsafe or does not match the run."""


class RecordError(ReprotrainError):
    """A run record (run.json, config.resolved.yaml, a jsonl file) is missing or unreadable.

    Raised by the tools before they act on a run, so a corrupt record is one line naming the
    file (and the line, for YAML/JSON syntax) instead of a traceback from deep inside a tool.
    """


class ArchiveError(ReprotrainError):
    """``make archive`` refused: nothing was written."""


class SnapshotError(ArchiveError):
    """The source snapshot cannot be built as the run ran (commit gone, diff does not apply)."""


class ReproduceRefused(ReprotrainError):
    """``make reproduce`` refused an archive (bad, tampered, unsafe, untrusted) or its data."""


class UntrustedArchive(ReproduceRefused):
    """No trust rule held for the archive's code; refused before any of it was extracted."""


class SigningError(ReprotrainError):
    """``ssh-keygen -Y sign/verify`` could not sign or check an archive."""
