"""User-facing errors: a ``ReprotrainError`` prints as one line (no traceback), exit non-zero."""


def one_line(text: object) -> str:
    """The text's non-blank lines, stripped, joined by ``; `` (empty when there is none)."""
    return "; ".join(p.strip() for p in str(text).strip().splitlines() if p.strip())


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
    """A run record (run.json, config.resolved.yaml, a jsonl) is missing or unreadable."""


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
