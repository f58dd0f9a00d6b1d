"""Progress of a long operation: a tqdm bar on a terminal, plain lines everywhere else.

A download, a sweep, an archive or a replay can run for minutes; a user should see that it
moves and how far it is. On a terminal (``stream.isatty()``) a tqdm bar redraws in place;
in a log file, a CI job or a pipe, a bar would be carriage-return noise, so the same
progress is a few plain lines instead: one per tenth of the total (and a last one), each
readable alone::

    download images.tar.gz: 81.3/162.6 MiB (50%)
    sweep multirun/smoke/x: 3/8 runs done (38%)
    reproduce [2/5] build the replay plan

Progress never changes what is computed: it only reads counts the caller already has.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from tqdm import tqdm

MIB = 1024 * 1024


def on_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


def _printer(stream: TextIO | None) -> Callable[[str], None]:
    """Print to ``stream``; None: to the ``sys.stderr`` of the moment of each line."""

    def emit(line: str) -> None:
        print(line, file=stream if stream is not None else sys.stderr, flush=True)

    return emit


def say(line: str) -> None:
    """A progress line on the ``sys.stdout`` of the moment: the tools' own status column,
    where a refusal's one ``error:`` line on stderr stays alone."""
    print(line, flush=True)


class Progress:
    """``what: done/total unit (pct%)``: a tqdm bar on a terminal, else a line per tenth.

    ``in_bytes``: count bytes, shown in MiB (tqdm scales them itself). ``emit``: where plain
    lines go (default: ``stream``); a caller inside a run passes its logger, so the lines
    land in the run's log too.
    """

    def __init__(
        self,
        what: str,
        total: int | None,
        *,
        unit: str = "",
        in_bytes: bool = False,
        stream: TextIO | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        self.what, self.total, self.unit, self.in_bytes = what, total or None, unit, in_bytes
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._emit = emit or _printer(self._stream)
        self._last_tenth = 0
        self._bar = None
        if on_terminal(self._stream):
            self._bar = tqdm(
                total=self.total,
                desc=what,
                unit="B" if in_bytes else (unit or "it"),
                unit_scale=in_bytes,
                unit_divisor=1024 if in_bytes else 1000,
                file=self._stream,
                leave=False,
                dynamic_ncols=True,
            )

    def _amount(self, n: float) -> str:
        return f"{n / MIB:.1f}" if self.in_bytes else str(int(n))

    def line(self) -> str:
        unit = " MiB" if self.in_bytes else (f" {self.unit}" if self.unit else "")
        if self.total is None:
            return f"{self.what}: {self._amount(self.done)}{unit}"
        pct = 100 * self.done / self.total
        amounts = f"{self._amount(self.done)}/{self._amount(self.total)}"
        return f"{self.what}: {amounts}{unit} ({pct:.0f}%)"

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        if self.total is None:
            return  # unknown total: only the last line
        tenth = min(10, int(10 * self.done / self.total))
        if tenth > self._last_tenth:
            self._last_tenth = tenth
            self._emit(self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.total is None or self._last_tenth < 10:
            self._emit(self.line())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Phases:
    """Numbered phases of one operation: ``reproduce [2/5] build the replay plan``.

    A phase may run a child (the trainer) that draws its own bar, so phases are lines on a
    terminal too, never a bar that the child's output would tear."""

    def __init__(
        self,
        what: str,
        names: Sequence[str],
        *,
        stream: TextIO | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        self.what, self.names = what, list(names)
        self._emit = emit or _printer(stream)

    def __call__(self, name: str) -> None:
        """Announce phase ``name`` (one of ``names``)."""
        number = self.names.index(name) + 1
        self._emit(f"{self.what} [{number}/{len(self.names)}] {name}")
