"""One command-line wrapper for every tool: ``--help`` works, every user error is one line.

Closes: tools that crash on ``--help`` and user errors as tracebacks. A usage error, a
``ReprotrainError`` or an ``OSError`` is one ``error:`` line, exit 2; anything else is a bug
and keeps its traceback. Inside :func:`stopping`, SIGTERM, SIGHUP and SIGUSR2 unwind like
Ctrl-C (:class:`Stopped`), so cleanup runs. docs/cli.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from reprotrain.errors import ReprotrainError, one_line
from reprotrain.shown import say

EXIT_USAGE = 2


class UsageError(ReprotrainError):
    """Bad command-line arguments (argparse's error, as one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse: must not return
        raise UsageError(f"{self.prog}: {message} (see --help)")


#: The name a tool is called by when the ``reprotrain`` command runs it (``reprotrain bisect``).
_PROG: ContextVar[str | None] = ContextVar("reprotrain_prog", default=None)


@contextlib.contextmanager
def prog(name: str) -> Iterator[None]:
    """Within this block, :func:`parser` names the tool ``name`` in its usage and errors."""
    token = _PROG.set(name)
    try:
        yield
    finally:
        _PROG.reset(token)


def parser(module: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """An argparse parser for ``python -m <module>`` whose description is the module doc."""
    return _Parser(
        prog=_PROG.get() or (f"python -m {module}" if "/" not in module else module),
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def user_path(text: str) -> Path:
    """An argparse type: a path with ``~`` expanded (Make passes it quoted)."""
    return Path(text).expanduser()


user_path.__name__ = "path"


def check_dir_arg(flag: str, path: Path) -> None:
    """One line when the nearest folder of ``path`` that exists is a file."""
    parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent}: {os.strerror(errno.ENOTDIR)}")


def pop_option(args: Sequence[str], flag: str, default: str | None) -> tuple[str | None, list[str]]:
    """(``flag v`` / ``flag=v`` anywhere, else ``default``; the other arguments)."""
    value, rest = default, []
    it = iter(args)
    for arg in it:
        if arg == flag:
            value = next(it, "")
        elif arg.startswith(f"{flag}="):
            value = arg.partition("=")[2]
        else:
            rest.append(arg)
    return value, rest


def stamped_dir(parent: Path) -> Path:
    """``<parent>/<date_time>-<pid>``, resolved: where one invocation writes."""
    return (Path(parent) / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}").resolve()


def argtype(convert: Callable[[str], Any], ok: Callable[[Any], bool], name: str) -> Callable:
    """An argparse type: ``convert(text)`` when ``ok`` holds; errors name the value ``name``."""

    def parse(text: str) -> Any:
        value = convert(text)
        if not ok(value):
            raise ValueError(text)
        return value

    parse.__name__ = name
    return parse


positive_int = argtype(int, lambda v: v >= 1, "positive integer")
positive_float = argtype(float, lambda v: math.isfinite(v) and v > 0, "finite positive number")
non_negative_float = argtype(
    float, lambda v: math.isfinite(v) and v >= 0, "finite non-negative number"
)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived; raised where the process was."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal}")


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stopping(handler: Callable[[int, object], None] = _raise_stopped) -> Iterator[None]:
    """Inside: each stop signal raises :class:`Stopped` (or calls ``handler``); the old
    handlers after."""
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def describe_os_error(e: OSError) -> str:
    """``<path>: <errno text>`` (both paths for a rename/copy), or the errno text alone."""
    what = e.strerror or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {what}" if paths else one_line(str(e) or what)


def entry_point(main: Callable[..., int]) -> Callable[..., int]:
    """A tool's ``main`` under the module docstring's rules; ``SystemExit`` returned as an int."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except SystemExit as e:
            code = e.code
            if code is None or isinstance(code, int):
                return code or 0
            print(f"error: {one_line(str(code))}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except BrokenPipeError:  # `... | head`: the reader left; nothing to report
            return 141
        except ReprotrainError as e:  # a user error: its one ``error:`` line, its exit code
            say(f"error: {one_line(str(e)) or type(e).__name__}", file=sys.stderr, flush=True)
            return int(e.exit_code)
        except OSError as e:
            say(f"error: {describe_os_error(e)}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            return 130

    return wrapped


def run_forwarding_errors(
    cmd: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str | None]:
    """Run a child, output streamed: (exit code, its last ``error:`` line, not to be repeated)."""
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, env=env, stderr=subprocess.PIPE, text=True, errors="replace"
    )
    last_error = None
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        if line.startswith("error:"):
            last_error = line.rstrip("\n")
    return proc.wait(), last_error
