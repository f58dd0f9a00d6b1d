"""How a training process ends: each failure to its exit code (docs/cli.md), recorded, then
cleaned up; the run directory's lock released on every way out.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

from reprotrain.data import worker_death
from reprotrain.distributed import Dist
from reprotrain.errors import ReprotrainError, ResumeError
from reprotrain.loop import Interrupted
from reprotrain.quoting import resume_hint
from reprotrain.resume.guard import AlreadyCompleted
from reprotrain.run import directory as run_dirs
from reprotrain.run import record as rec
from reprotrain.run.mutex import RunMutex
from reprotrain.shown import safe_line

log = logging.getLogger("reprotrain")
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: "try again later", what a requeue wrapper looks for
EXIT_ABORTED = 130


class Exits:
    """``with Exits(run_dir) as ends:`` around the whole process: the run dir, world and lock,
    set as they are made, are what its exits mark, release and destroy."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.dist: Dist | None = None
        self.lock: RunMutex | None = None

    def __enter__(self) -> Exits:
        return self

    def __exit__(self, exc_type: type | None, e: BaseException | None, tb: Any) -> bool:
        try:
            code = None if e is None else self.exit_code(e)
        finally:
            worker_death.stop_workers()  # loader workers ignore SIGTERM: never wait on them
            self.release()
            if self.dist is not None:
                self.dist.destroy()
        if code is None:
            return False  # completed, or an error re-raised as it is
        sys.exit(code)

    def claim(self, run_dir: Path, resume: str | None) -> None:
        """Rank 0 locks the run directory and refuses a written one; every rank gets the verdict."""
        refused = None
        if self.dist.is_main:
            try:
                self.lock = RunMutex(run_dir).acquire()  # one writer per run dir
                run_dirs.refuse_reuse(run_dir, resume)  # written once (rank 0 decides)
            except ResumeError as e:
                refused = str(e)
        if (refused := self.dist.broadcast_object(refused)) is not None:
            raise ResumeError(refused)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def exit_code(self, e: BaseException) -> int | None:
        """Record ``e`` and say what it ends in: an exit code, or None to re-raise it."""
        if isinstance(e, Interrupted):  # checkpointed and recorded by the loop
            if e.stop.signal_name == "SIGUSR2" and e.stop.requeue is not None:
                self.release()
                e.stop.requeue(signal.SIGUSR2, None)  # submitit requeues the job and exits
            return EXIT_INTERRUPTED
        if isinstance(e, AlreadyCompleted):
            print(safe_line(e), file=sys.stderr)
            return 0
        if isinstance(e, ResumeError):  # refused before touching anything: record untouched
            self.error(str(e))
            return e.exit_code
        if isinstance(e, ReprotrainError):
            self.fail("failed", str(e), **getattr(e, "record", {}))
            return e.exit_code
        if isinstance(e, OSError) and not worker_death.is_worker_death(e):
            # disk full, a path that is a file, a name too long: name it
            where = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
            self.fail("failed", f"{where}: {e.strerror or e}" if where else str(e))
            return 2
        if isinstance(e, KeyboardInterrupt):
            mark(self.run_dir, "interrupted", error="aborted by a second SIGINT")
            print("aborted: previous checkpoints are intact", file=sys.stderr)
            return EXIT_ABORTED
        if isinstance(e, OSError | RuntimeError) and worker_death.is_worker_death(e):
            died = worker_death.describe(e)  # a DataLoader worker was killed: resumable
            message = (
                f"{died} (killed from outside, e.g. by the OOM killer); the run stopped "
                f"at its last checkpoint: resume with `{resume_hint(self.run_dir)}`"
            )
            self.fail("interrupted", message, error=died, interrupted_by="DataLoader worker died")
            return EXIT_INTERRUPTED
        if isinstance(e, Exception):
            mark(self.run_dir, "failed", error=f"{type(e).__name__}: {e}")
        return None

    def fail(self, status: str, message: str, **fields: Any) -> None:
        """Mark the run, log and print one line."""
        mark(self.run_dir, status, **{"error": message, **fields})
        log_error(message)
        self.error(message)

    def error(self, message: str) -> None:
        if self.dist is None or self.dist.is_main:  # a message may quote a value as typed
            print(safe_line(f"error: {message}"), file=sys.stderr)


def mark(run_dir: Path, status: str, **fields: Any) -> None:
    """Record a failure without ever masking the original error."""
    try:
        path = run_dir / rec.RUN_JSON
        record = rec.RunRecord.load(run_dir) if path.exists() else rec.RunRecord(run_dir)
        try:
            record.update(status=status, finished_at=rec.now_iso(), **fields)
        except OSError:  # no room for a new file (disk full): reuse run.json's own blocks
            rec.write_in_place(path, rec.strict_json(record.data, indent=2).encode())
    except Exception as e:  # pragma: no cover - best effort
        print(f"warning: could not update run.json: {e}", file=sys.stderr)


def log_error(message: str) -> None:
    """The error into train.log too; a log that cannot be written (a full disk) stays quiet."""
    raising, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        log.error(message)
    finally:
        logging.raiseExceptions = raising
