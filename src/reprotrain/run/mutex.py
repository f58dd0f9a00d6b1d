"""One writer per run directory: a lock file that a run holds for its whole lifetime.
Closes: two processes writing one run directory (a second ``resume=auto`` while the first is
alive). ``RUN_DIR/.lock`` names the holder, appears atomically by ``link()``, is held under
``flock`` and heartbeat; docs/scaling-out.md has each rule and the file systems it holds on."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from reprotrain.errors import ResumeError
from reprotrain.run.record import now_iso

log = logging.getLogger("reprotrain")

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = float(os.environ.get("REPROTRAIN_LOCK_STALE_S", 600))
_FLOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_HELD_FDS: set[int] = set()


def _drop_held_fds_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep our flock alive after we die."""
    for fd in _HELD_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_FDS.clear()


os.register_at_fork(after_in_child=_drop_held_fds_in_child)


class RunBusyError(ResumeError):
    """Another live process writes this run directory; nothing here was touched (a
    ``ResumeError``: one line, and the other run's ``run.json`` is not marked failed)."""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    if (stat := _read(f"/proc/{pid}/stat")) is None:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def pid_exists(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (killed, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    stat = _read(f"/proc/{pid}/stat")
    return stat is None or stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory's lock."""

    host: str
    pid: int
    started_at: str
    pid_start: int | None = None
    boot_id: str | None = None
    pid_ns: str | None = None
    job_id: str | None = None
    job_restart: int = 0
    token: str = ""

    @classmethod
    def me(cls) -> Holder:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            pid=pid,
            started_at=now_iso(),
            pid_start=proc_start_ticks(pid),
            boot_id=_read("/proc/sys/kernel/random/boot_id"),
            pid_ns=_pid_namespace(),
            job_id=os.environ.get("SLURM_JOB_ID"),
            job_restart=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            token=secrets.token_hex(8),
        )

    @classmethod
    def parse(cls, text: str) -> Holder:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    def describe(self) -> str:
        job = f", SLURM job {self.job_id}" if self.job_id else ""
        return f"host {self.host}, pid {self.pid}, started {self.started_at}{job}"


def judge(holder: Holder, lock_mtime: float, stale_after_s: float) -> str | None:
    """Why ``holder`` is certainly gone, or None if it may still be writing."""
    me = Holder.me()
    if holder.host == me.host and holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
        return "this host has rebooted since"
    same_ns = holder.pid_ns is None or me.pid_ns is None or holder.pid_ns == me.pid_ns
    if holder.host == me.host and same_ns:  # same host, same boot (checked above)
        if not pid_exists(holder.pid):
            return "that process is gone"
        now_start = proc_start_ticks(holder.pid)
        if holder.pid_start is not None and now_start is not None and now_start != holder.pid_start:
            return "that pid now belongs to another process"
        return None
    if holder.job_id and holder.job_id == me.job_id and me.job_restart > holder.job_restart:
        return f"this is a requeue of the same SLURM job (restart {me.job_restart})"
    if (age := time.time() - lock_mtime) > stale_after_s:
        return f"no heartbeat for {age:.0f} s (stale after {stale_after_s:.0f} s)"
    return None


def _flock(fd: int) -> bool | None:
    """Try an exclusive flock: True taken, False held elsewhere, None unsupported here."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in _FLOCK_UNSUPPORTED:
            return None
        raise
    return True


class RunMutex:
    """Hold ``RUN_DIR/.lock`` for a run's lifetime: ``with RunMutex(run_dir): train()``."""

    def __init__(
        self,
        run_dir: Path | str,
        stale_after_s: float = STALE_AFTER_S,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.me = Holder.me()
        self.took_over: Holder | None = None  # the dead holder we replaced, if any
        self.lost = False  # set by the heartbeat if another process replaced our lock
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> RunMutex:
        """Take the lock, or raise ``RunBusyError`` naming the live holder."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        holder: Holder | None = None
        for _ in range(5):
            # Look before writing anything, so a refused writer leaves the directory as it was.
            holder, reason = self._inspect()
            if holder is not None and reason is None:
                raise self._refusal(holder)
            if holder is None:
                if self._create():
                    break
            elif self._take_over(holder, reason):
                break
            time.sleep(0.05)
        else:
            raise self._refusal(holder)
        self._beat = threading.Thread(target=self._heartbeat, name="runlock", daemon=True)
        self._beat.start()
        return self

    def release(self) -> None:
        """Remove the lock if it is still ours; always close our descriptor."""
        if os.getpid() != self.me.pid:
            return  # a forked child: the lock belongs to the parent
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._fd is None:
            return
        try:
            if self._still_ours():
                self.path.unlink(missing_ok=True)
        finally:
            _HELD_FDS.discard(self._fd)
            os.close(self._fd)  # also drops the flock
            self._fd = None

    def check(self) -> None:
        """Raise if another process has replaced our lock (we were judged dead)."""
        if self.lost or not self._still_ours():
            self.lost = True
            raise RunBusyError(
                f"the lock on {self.run_dir} was taken over by another process; "
                "stop this run, it is no longer the only writer"
            )

    def __enter__(self) -> RunMutex:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refusal(self, holder: Holder | None) -> RunBusyError:
        who = holder.describe() if holder else "a process whose lock file cannot be read"
        return RunBusyError(
            f"{self.run_dir} is being written by another run ({who}); wait for it or stop it "
            f"(if that process is certainly gone, delete {self.path})"
        )

    def _create(self) -> bool:
        """Publish our lock file atomically with its content; False if one exists."""
        tmp = self.run_dir / f"{LOCK_NAME}.{self.me.host}.{self.me.pid}.{self.me.token}"
        self._write_new(tmp)
        try:
            os.link(tmp, self.path)
        except OSError as e:
            if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):  # no hard links here
                tmp.unlink(missing_ok=True)
                return self._create_excl()
            # NFS may report failure (even EEXIST) for a link that was made when a reply was
            # lost and the request retransmitted: the temp file's link count settles it.
            if os.stat(tmp).st_nlink != 2:
                tmp.unlink(missing_ok=True)
                if isinstance(e, FileExistsError):
                    return False
                raise
        tmp.unlink(missing_ok=True)
        self._hold()
        return True

    def _create_excl(self) -> bool:
        try:
            self._write_new(self.path)
        except FileExistsError:
            return False
        self._hold()
        return True

    def _write_new(self, path: Path) -> None:
        """Create ``path`` (``O_EXCL``) holding our record, fsynced."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, self.me.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def _hold(self) -> None:
        """Open our lock and flock it; a takeover candidate may hold the flock for a moment."""
        self._fd = os.open(self.path, os.O_RDWR)
        _HELD_FDS.add(self._fd)
        for _ in range(100):
            if (got := _flock(self._fd)) is None:
                log.debug("flock is not supported on %s; takeovers are not serialised", self.path)
                return
            if got:
                return
            time.sleep(0.02)  # a candidate is checking us; it will find us alive and let go

    def _inspect(self) -> tuple[Holder | None, str | None]:
        """(holder, reason it is dead or None). (None, None): the lock vanished meanwhile."""
        try:
            text, mtime = self.path.read_text(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None, None
        try:
            holder = Holder.parse(text)
        except (ValueError, TypeError):
            if (age := time.time() - mtime) > self.stale_after_s:
                return Holder(host="?", pid=0, started_at="?"), f"unreadable and {age:.0f} s old"
            raise RunBusyError(
                f"{self.path} exists but cannot be read (written {age:.0f} s ago); if no run "
                "is writing this directory, delete it"
            ) from None
        return holder, judge(holder, mtime, self.stale_after_s)

    def _take_over(self, dead: Holder, reason: str) -> bool:
        """Replace a dead holder's lock in place, under flock so only one candidate wins."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        keep = False
        try:
            if (got := _flock(fd)) is False:
                return False  # a live holder or another candidate has it: look again
            same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            current = os.pread(fd, 65536, 0).decode(errors="replace")
            try:
                still_dead = same_file and Holder.parse(current).token == dead.token
            except (ValueError, TypeError):
                still_dead = same_file and dead.pid == 0
            if not still_dead:
                return False
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.me.to_json().encode(), 0)
            os.fsync(fd)
            if got is None:  # no flock here: a concurrent candidate may have written too
                time.sleep(0.2)
                if Holder.parse(os.pread(fd, 65536, 0).decode()).token != self.me.token:
                    return False
            keep = True
        finally:
            if not keep:
                os.close(fd)
        self._fd = fd
        _HELD_FDS.add(fd)
        self.took_over = dead
        who = dead.describe()
        log.warning(
            "taking over the lock of %s from a dead writer (%s): %s", self.run_dir, who, reason
        )
        return True

    def _still_ours(self) -> bool:
        try:
            same_file = os.fstat(self._fd).st_ino == os.stat(self.path).st_ino
            text = os.pread(self._fd, 65536, 0).decode()
            return same_file and Holder.parse(text).token == self.me.token
        except (OSError, ValueError, TypeError):
            return False

    def _heartbeat(self) -> None:
        """Touch the lock so other hosts can tell a live holder from a dead one."""
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                os.utime(self._fd)
            if not self._still_ours() and not self.lost:
                self.lost = True
                log.error("the lock on %s was taken over by another process", self.run_dir)


def held_by(run_dir: Path | str, stale_after_s: float = STALE_AFTER_S) -> Holder | None:
    """The live holder of ``run_dir``'s lock, or None. Reads only; changes nothing."""
    path = Path(run_dir) / LOCK_NAME
    try:
        text, mtime = path.read_text(), path.stat().st_mtime
        holder = Holder.parse(text)
    except (OSError, ValueError, TypeError):
        return None
    return None if judge(holder, mtime, stale_after_s) else holder


def refuse_if_held(run_dir: Path | str) -> None:
    """Raise ``RunBusyError`` if a live run holds ``run_dir``: a pre-check before anything
    writes there (Hydra's ``.hydra/``); ``RunMutex.acquire`` stays the real guard."""
    if (holder := held_by(run_dir)) is not None:
        raise RunMutex(run_dir)._refusal(holder)
