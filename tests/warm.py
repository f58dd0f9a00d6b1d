"""A warm interpreter for the tests' own ``python -m reprotrain...`` processes (tests only).

Why: a fresh trainer process on 2 cores spends about 4.5 s importing torch, ``torch._dynamo``
(torch's optimizers import it on first use) and Hydra, most of the time ``make test`` takes.
A zygote, one per pytest worker, imports those once; each command forks from it and then
becomes what ``python -m <module> <args>`` (or ``python <script> <args>``) would be:

- its argv (``sys.argv`` as ``-m`` sets it, ``sys.orig_argv``), working directory,
  ``sys.path[0]``, environment and stdin/stdout/stderr are the command's;
- Python's, NumPy's and torch's global generators get fresh entropy, as each does when a
  fresh process imports it, so twins cannot agree through a shared global state;
- ``__main__`` is a fresh module, and the interpreter exits as a fresh one would: atexit
  handlers, threads joined, buffers flushed; a signal's death is the exit status.

What a child shares with its zygote is the interpreter's start and the modules imported
before the fork, so a zygote is started with the command's own environment, and serves only
commands that agree with it on every variable read at interpreter start or at those imports
(``START_VARIABLES``, a fixed ``PYTHONHASHSEED`` included), with no interpreter flags, no
stdin and no process options but a new session. A warm child's own command in its process
group (no new session: a ``killpg`` or Ctrl-C must reach both) forks from the zygote too
while the caller is in the zygote's group (the fork lands there: the same group; its parent
pid is the zygote's, which only torchrun's workers read, never warm); when the caller leads
a group of its own, such a command, everything else, and every run with
``REPROTRAIN_TEST_COLD=1``, starts cold. ``tests/test_warm.py`` holds the
equivalence: a trainer run warm and cold gives the same bits and record; argv, paths,
environment, exit statuses, atexit, timeouts and fresh entropy are a fresh process's.

This module is a pytest plugin (``conftest``): it installs :class:`Popen` as
``subprocess.Popen``, in the pytest process and in every warm child, so ``subprocess.run`` and
the framework's own launchers (resume, verify, reproduce run a trainer) start what qualifies
warm and hand everything else to the real ``subprocess.Popen``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Read when an interpreter starts or while the zygote's modules import (locale, hash seed,
#: paths, thread pools, CPU dispatch, CUDA, temp dir): a command warm only where all agree.
START_VARIABLES = re.compile(
    r"^(PYTHON|LC_|LANG|OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|NUMEXPR_|TORCH|PYTORCH_|CUDA|CUBLAS|"
    r"NVIDIA_|LD_|DNNL_|ONEDNN_|ATEN_|HYDRA_|TMPDIR$|TEMP$|TMP$)"
)
#: What the zygote imports before it forks: what every trainer and most tools import.
PRELOAD = ("numpy", "torch", "torch._dynamo", "yaml", "omegaconf", "hydra", "hydra.main")
_ZYGOTE_DIR = Path(__file__).resolve().parent

_RealPopen = subprocess.Popen
#: In a warm child: its zygote's socket and start-up signature (nested commands fork there).
_parent_zygote: dict = {}
_cold = {"forced": False}
#: One zygote per set of start-up variables, the least recently used ended beyond these.
MAX_ZYGOTES = 3
_zygotes: dict[tuple, tuple[subprocess.Popen, str]] = {}
_seen: set[tuple] = set()
#: How many commands ran each way in this process (tests/test_warm.py reads it).
counts = {"warm": 0, "cold": 0, "zygotes": 0}


# ------------------------------------------------------------------------------ the client


def warm_command(args, kwargs: dict, honour_cold: bool = True) -> tuple[list[str], bool] | None:
    """(the argv after the interpreter, is_module) when ``subprocess.run(args, **kwargs)`` may
    run warm, else None."""
    if honour_cold and (_cold["forced"] or os.environ.get("REPROTRAIN_TEST_COLD") == "1"):
        return None
    if not isinstance(args, list | tuple) or len(args) < 2:
        return None
    if _parent_zygote and not kwargs.get("start_new_session") and _leads_a_group():
        return None  # its child must join the group it leads (killpg, Ctrl-C): a fork of
        # the zygote cannot join a group of another session, so it starts for real
    if not all(isinstance(a, str | os.PathLike) for a in args):
        return None
    args = [os.fspath(a) for a in args]
    here = os.fspath(kwargs.get("cwd") or os.getcwd())
    console = _console_script(os.path.join(here, args[0]))
    if console:  # a script of this venv: `python <script>`, as its #! says
        args = [sys.executable, *args]
    if args[0] != sys.executable:
        return None
    allowed = {"cwd", "env", "text", "universal_newlines", "stdout", "stderr", "stdin",
               "encoding", "errors", "start_new_session", "close_fds", "bufsize"}  # fmt: skip
    if set(kwargs) - allowed or kwargs.get("close_fds") is False:
        return None
    if kwargs.get("stdin") not in (None, subprocess.DEVNULL):
        return None
    if args[1] == "-m":
        if len(args) < 3 or not args[2].startswith("reprotrain"):
            return None
        return args[2:], True
    script = Path(here, args[1])
    if args[1].startswith("-") or not (console or script.suffix == ".py") or not script.is_file():
        return None
    return args[1:], False


def _leads_a_group() -> bool:
    """In a warm child: True when it is no longer in its zygote's process group (it was
    started in a session of its own, or left the group). A fork of the zygote lands in the
    zygote's group, so it is the caller's own group only while the caller stays there."""
    return os.getpgid(0) != _parent_zygote["pgid"]


def _console_script(name: str) -> bool:
    """True for an executable whose first line is ``#!<this interpreter>``."""
    if os.sep not in name:
        return False
    try:
        with open(name, "rb") as f:
            return f.readline().rstrip(b"\n") == b"#!" + os.fsencode(sys.executable)
    except OSError:
        return False


def signature(env: dict[str, str]) -> tuple[tuple[str, str], ...] | None:
    """The start-up variables of ``env``: commands that share it may share a zygote. None
    without a fixed hash seed (a fresh process would draw its own)."""
    if not env.get("PYTHONHASHSEED", "").isdigit():
        return None
    return tuple(sorted((k, v) for k, v in env.items() if START_VARIABLES.match(k)))


class Popen(_RealPopen):
    """``subprocess.Popen``, warm where that gives what a fresh process gives: a command that
    qualifies gets a :class:`WarmPopen`, everything else the real thing. Installed as
    ``subprocess.Popen`` in the pytest process and in every warm child, so ``subprocess.run``
    and the framework's own launchers (resume, verify, reproduce...) start warm too."""

    def __new__(cls, *args, **kwargs):
        command = args[0] if args else kwargs.get("args")
        found = warm_command(command, {k: v for k, v in kwargs.items() if k != "args"})
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        path = None
        if found is not None and len(args) <= 1:
            path = _socket_path(env, at_once="reprotrain.train" in found[0][:4])
        if path is None:
            counts["cold"] += 1
            return super().__new__(cls)
        counts["warm"] += 1
        return WarmPopen(path, list(command), found, env, kwargs)


def run_cold(args: list, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` with a real, fresh process, whatever the command."""
    _cold["forced"] = True
    try:
        return subprocess.run(args, **kwargs)
    finally:
        _cold["forced"] = False


def run_warm(args: list, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, **kwargs)`` in a zygote's child, or ValueError when it cannot."""
    timeout = kwargs.pop("timeout", None)
    if kwargs.pop("capture_output", False):
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    found = warm_command(args, kwargs, honour_cold=False)
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    path = _socket_path(env, at_once=True) if found is not None else None
    if path is None:
        raise ValueError(f"not a command that can run warm: {args}")
    with WarmPopen(path, list(args), found, env, kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _socket_path(env: dict[str, str], at_once: bool = False) -> str | None:
    """The socket of the zygote that started with ``env``'s start-up variables (started
    now with ``env`` when these were seen before, or ``at_once``: a trainer's, which imports
    torch once its check passes, so a zygote and its child cost less than one cold start).
    In a warm child: its own zygote's, for a command that starts alike, else None."""
    key = signature(env)
    if key is None:
        return None
    if _parent_zygote:
        return _parent_zygote["path"] if key == _parent_zygote["key"] else None
    proc, path = _zygotes.pop(key, (None, ""))
    if proc is not None and proc.poll() is None:
        _zygotes[key] = (proc, path)  # the most recently used last
        return path
    if key not in _seen and not at_once:  # a zygote costs a cold start: from the 2nd on
        _seen.add(key)
        return None
    while len(_zygotes) >= MAX_ZYGOTES:
        oldest = next(iter(_zygotes))
        _stop(*_zygotes.pop(oldest))
    folder = tempfile.mkdtemp(prefix="reprotrain-warm-")
    path = os.path.join(folder, "zygote.sock")
    proc = _RealPopen(
        [sys.executable, str(_ZYGOTE_DIR / "warm.py"), path],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, cwd=folder,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the warm zygote did not start (exit {proc.poll()})")
        time.sleep(0.05)
    _zygotes[key] = (proc, path)
    counts["zygotes"] += 1
    return path


def _stop(proc: subprocess.Popen, path: str) -> None:
    """End a zygote and remove its socket's folder."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def stop() -> None:
    """End the zygotes (their children run on to their own end)."""
    while _zygotes:
        _stop(*_zygotes.popitem()[1])


class WarmPopen:
    """What callers use of ``subprocess.Popen``, for a child forked by a zygote: the real
    ``pid`` (signals reach it), ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``terminate``, ``kill``, ``returncode``, ``stdout``/``stderr`` pipes, ``with``. The exit
    status comes from the zygote, the child's parent."""

    def __init__(self, path: str, args: list, found: tuple[list[str], bool], env: dict, kw):
        self.args, self.returncode, self.stdin = args, None, None
        self._chunks: tuple[list[bytes], list[bytes]] = ([], [])
        self._text = bool(kw.get("text") or kw.get("universal_newlines") or kw.get("encoding")
                          or kw.get("errors"))  # fmt: skip
        self._encoding, self._errors = kw.get("encoding"), kw.get("errors")
        closers: list[int] = []
        out_fd, out_pipe = _output(kw.get("stdout"), closers, 1)
        if kw.get("stderr") == subprocess.STDOUT:
            err_fd, err_pipe = out_fd, None
        else:
            err_fd, err_pipe = _output(kw.get("stderr"), closers, 2)
        in_fd = os.open(os.devnull, os.O_RDONLY)
        closers.append(in_fd)
        self.stdout = self._reader(out_pipe)
        self.stderr = self._reader(err_pipe)
        argv, is_module = found
        # As bytes, decoded by the child as a fresh process decodes its own (its locale's codec).
        request = {
            "argv": [_raw(a) for a in argv], "module": is_module,
            "cwd": os.path.abspath(os.fspath(kw.get("cwd") or os.getcwd())),
            "env": {_raw(k): _raw(v) for k, v in env.items()},
            "session": bool(kw.get("start_new_session")),
        }  # fmt: skip
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._conn.connect(path)
            socket.send_fds(self._conn, [json.dumps(request).encode()], [in_fd, out_fd, err_fd])
            self.pid = json.loads(self._conn.recv(4096))["pid"]
        finally:
            for fd in closers:
                os.close(fd)

    def _reader(self, fd: int | None):
        if fd is None:
            return None
        if self._text:
            import locale

            encoding = self._encoding or locale.getpreferredencoding(False)
            return io.TextIOWrapper(open(fd, "rb"), encoding=encoding, errors=self._errors)
        return open(fd, "rb")

    def _status(self, data: bytes) -> int:
        if not data:
            raise RuntimeError("the warm zygote went away before its child's exit status")
        self.returncode = json.loads(data)["code"]
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                data = self._conn.recv(4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            self._status(data)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                data = self._conn.recv(4096)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._status(data)
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None):
        """Read both pipes to their end, then wait (``TimeoutExpired`` as Popen raises it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = (self.stdout, self.stderr)
        live = {f.fileno(): i for i, f in enumerate(streams) if f is not None and not f.closed}
        while live:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            ready, _, _ = select.select(list(live), [], [], left)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    self._chunks[live[fd]].append(data)
                else:
                    streams[live.pop(fd)].close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        return tuple(
            self._decode(b"".join(self._chunks[i])) if f is not None else None
            for i, f in enumerate(streams)
        )

    def _decode(self, data: bytes | None):
        if data is None or not self._text:
            return data
        import locale

        text = data.decode(self._encoding or locale.getpreferredencoding(False),
                           self._errors or "strict")  # fmt: skip
        return text.replace("\r\n", "\n").replace("\r", "\n")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmPopen:
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.stdout, self.stderr):
            if f is not None and not f.closed:
                f.close()
        self.wait()


def _raw(text) -> str:
    return os.fsencode(text).decode("latin-1")


def _output(spec, closers: list[int], own: int) -> tuple[int, int | None]:
    """(the fd the child writes to, the read end the caller keeps when it is a pipe)."""
    if spec is None:
        fd = os.dup(own)  # the caller's own stdout (1) or stderr (2)
        closers.append(fd)
        return fd, None
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY)
        closers.append(fd)
        return fd, None
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        closers.append(w)
        return w, r
    return (spec if isinstance(spec, int) else spec.fileno()), None


# ------------------------------------------------------------------------------ the zygote


def serve(path: str) -> None:
    """Import ``PRELOAD``, then fork one child per request; report each child's exit status."""
    import importlib

    own = {"path": path, "key": signature(dict(os.environ)), "pgid": os.getpgid(0)}
    for name in PRELOAD:
        importlib.import_module(name)
    # The collector never walks what was imported here: a child's first collection would
    # otherwise visit (and so copy, page by page, from its parent) every object torch made,
    # which made a warm child's start slower than a cold one's (2.4 s against 0.6 s for a
    # command refused before torch is imported). A fresh process frees none of them either.
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(children)
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                held = [c.detach() for c in children.values()]
                for fd in (listener.detach(), wake_r, wake_w, *held):
                    os.close(fd)
                conn.close()
                become(request, fds, own)  # never returns
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            conn.send(json.dumps({"pid": pid}).encode())
            _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # the client is gone (its test timed out)
                conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def become(request: dict, fds: list[int], zygote: dict) -> None:
    """In the forked child: turn into ``python [-m] <argv>`` as a fresh process would be; its
    own warm commands fork from the same zygote."""
    import random
    import runpy
    import types

    import numpy
    import torch

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    if request["session"]:
        os.setsid()
    _parent_zygote.update(zygote)
    subprocess.Popen = Popen
    os.chdir(request["cwd"])
    os.environb.clear()
    os.environb.update({k.encode("latin-1"): v.encode("latin-1")
                        for k, v in request["env"].items()})  # fmt: skip
    tempfile.tempdir = None
    random.seed()  # CPython reseeds at fork too; fresh entropy either way
    numpy.random.seed()  # a fresh process seeds NumPy's global state from the OS
    torch.seed()  # ... and torch's default generator
    argv = [os.fsdecode(a.encode("latin-1")) for a in request["argv"]]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main  # as multiprocessing aliases it
    if request["module"]:
        sys.orig_argv = [sys.executable, "-m", *argv]
        sys.argv = ["-m", *argv[1:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[0], alter_argv=True)
    else:
        sys.orig_argv = [sys.executable, *argv]
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


# ------------------------------------------------------------------------ the pytest plugin


def pytest_configure(config) -> None:
    subprocess.Popen = Popen


def pytest_unconfigure(config) -> None:
    subprocess.Popen = _RealPopen
    stop()


if __name__ == "__main__":
    serve(sys.argv[1])
