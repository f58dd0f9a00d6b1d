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
stdin input and no process options; everything else, and every run with
``REPROTRAIN_TEST_COLD=1``, starts cold. ``tests/test_warm.py`` holds the equivalence: a
trainer run warm and cold gives the same bits and record; argv, paths, environment, exit
statuses, atexit, timeouts and fresh entropy are a fresh process's.

``conftest`` routes ``subprocess.run`` through :func:`run`, which sends what qualifies warm
and hands everything else to the real ``subprocess.run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
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

_real_run = subprocess.run
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
    if honour_cold and os.environ.get("REPROTRAIN_TEST_COLD") == "1":
        return None
    if not isinstance(args, list | tuple) or len(args) < 2:
        return None
    if not all(isinstance(a, str | os.PathLike) for a in args):
        return None
    args = [os.fspath(a) for a in args]
    here = os.fspath(kwargs.get("cwd") or os.getcwd())
    console = _console_script(os.path.join(here, args[0]))
    if console:  # a script of this venv: `python <script>`, as its #! says
        args = [sys.executable, *args]
    if args[0] != sys.executable:
        return None
    allowed = {"cwd", "env", "text", "universal_newlines", "capture_output", "stdout", "stderr",
               "stdin", "timeout", "check", "input", "encoding", "errors"}  # fmt: skip
    if set(kwargs) - allowed or kwargs.get("input") is not None:
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


def run(*popenargs, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run``, warm where that gives what a fresh process gives."""
    args = popenargs[0] if popenargs else kwargs.get("args")
    rest = {k: v for k, v in kwargs.items() if k != "args"}
    found = warm_command(args, rest) if len(popenargs) <= 1 else None
    env = dict(os.environ if rest.get("env") is None else rest["env"])
    path = _socket_path(env) if found is not None else None
    if path is None:
        counts["cold"] += 1
        return _real_run(*popenargs, **kwargs)
    counts["warm"] += 1
    return _run_warm(path, list(args), found, env, rest)


def run_warm(args: list, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, **kwargs)`` in a zygote's child, or ValueError when it cannot."""
    found = warm_command(args, kwargs, honour_cold=False)
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    path = _socket_path(env, at_once=True) if found is not None else None
    if path is None:
        raise ValueError(f"not a command that can run warm: {args}")
    return _run_warm(path, list(args), found, env, kwargs)


def _socket_path(env: dict[str, str], at_once: bool = False) -> str | None:
    """The socket of the zygote that started with ``env``'s start-up variables (started
    now with ``env`` when these were seen before, or ``at_once``)."""
    key = signature(env)
    if key is None:
        return None
    proc, path = _zygotes.pop(key, (None, ""))
    if proc is not None and proc.poll() is None:
        _zygotes[key] = (proc, path)  # the most recently used last
        return path
    if key not in _seen and not at_once:  # a zygote costs a cold start: from the 2nd on
        _seen.add(key)
        return None
    while len(_zygotes) >= MAX_ZYGOTES:
        oldest = next(iter(_zygotes))
        _stop(_zygotes.pop(oldest)[0])
    folder = tempfile.mkdtemp(prefix="reprotrain-warm-")
    path = os.path.join(folder, "zygote.sock")
    proc = subprocess.Popen(
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


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def stop() -> None:
    """End the zygotes (their children run on to their own end)."""
    while _zygotes:
        _stop(_zygotes.popitem()[1][0])


def _output_fd(spec, pipes: list, closers: list) -> int:
    if spec is None:
        return -1  # the caller's own
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY)
        closers.append(fd)
        return fd
    if spec == subprocess.PIPE:
        r, w = os.pipe()
        pipes.append(r)
        closers.append(w)
        return w
    return spec if isinstance(spec, int) else spec.fileno()


def _run_warm(path: str, args: list, found: tuple[list[str], bool], env: dict, kw: dict):
    argv, is_module = found
    out_spec, err_spec = kw.get("stdout"), kw.get("stderr")
    if kw.get("capture_output"):
        out_spec = err_spec = subprocess.PIPE
    pipes: list[int] = []
    closers: list[int] = []
    out_fd = _output_fd(out_spec, pipes, closers)
    out_pipe = pipes[-1] if out_spec == subprocess.PIPE else None
    if err_spec == subprocess.STDOUT:
        err_fd, err_pipe = out_fd, None
    else:
        err_fd = _output_fd(err_spec, pipes, closers)
        err_pipe = pipes[-1] if err_spec == subprocess.PIPE else None
    in_fd = os.open(os.devnull, os.O_RDONLY)
    closers.append(in_fd)
    fds = [in_fd, out_fd if out_fd >= 0 else 1, err_fd if err_fd >= 0 else 2]
    cwd = os.path.abspath(os.fspath(kw.get("cwd") or os.getcwd()))
    # As bytes, decoded by the child as a fresh process decodes its own (its locale's codec).
    raw = [os.fsencode(a).decode("latin-1") for a in argv]
    raw_env = {os.fsencode(k).decode("latin-1"): os.fsencode(v).decode("latin-1")
               for k, v in env.items()}  # fmt: skip
    request = {"argv": raw, "module": is_module, "cwd": cwd, "env": raw_env}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        for fd in closers:
            os.close(fd)
        pid = json.loads(conn.recv(4096))["pid"]
        timeout = kw.get("timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        captured = _read_until_eof(pipes, deadline, pid, args, timeout)
        conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        try:
            code = json.loads(conn.recv(4096))["code"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(args, timeout) from None
    finally:
        conn.close()
    out = captured.get(out_pipe, b"") if out_pipe is not None else None
    err = captured.get(err_pipe, b"") if err_pipe is not None else None
    if kw.get("text") or kw.get("universal_newlines") or kw.get("encoding") or kw.get("errors"):
        out, err = (_text(x, kw) for x in (out, err))
    done = subprocess.CompletedProcess(args, code, out, err)
    if kw.get("check"):
        done.check_returncode()
    return done


def _read_until_eof(pipes: list[int], deadline, pid: int, args, timeout) -> dict[int, bytes]:
    chunks: dict[int, list[bytes]] = {fd: [] for fd in pipes}
    open_fds = list(pipes)
    try:
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                os.kill(pid, signal.SIGKILL)
                got = {fd: b"".join(c) for fd, c in chunks.items()}
                out = got.get(pipes[0]) if pipes else None
                err = got.get(pipes[1]) if len(pipes) > 1 else None
                raise subprocess.TimeoutExpired(args, timeout, out, err)
            ready, _, _ = select.select(open_fds, [], [], left)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
    finally:
        for fd in pipes:
            os.close(fd)
    return {fd: b"".join(c) for fd, c in chunks.items()}


def _text(data: bytes | None, kw: dict) -> str | None:
    """As ``subprocess`` decodes in text mode: the locale's (or the given) encoding, and
    universal newlines."""
    if data is None:
        return None
    import locale

    encoding = kw.get("encoding") or locale.getpreferredencoding(False)
    text = data.decode(encoding, kw.get("errors") or "strict")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# ------------------------------------------------------------------------------ the zygote


def serve(path: str) -> None:
    """Import ``PRELOAD``, then fork one child per request; report each child's exit status."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
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
                become(request, fds)  # never returns
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


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into ``python [-m] <argv>`` as a fresh process would be."""
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
    subprocess.run = run


def pytest_unconfigure(config) -> None:
    subprocess.run = _real_run
    stop()


if __name__ == "__main__":
    serve(sys.argv[1])
