"""Progress of a long operation: a tqdm bar on a terminal, plain lines everywhere else.

A download, a sweep, an archive or a replay can run for minutes; a user should see that it
moves and how far it is. On a terminal (``stream.isatty()``) a tqdm bar redraws in place;
in a log file, a CI job or a pipe, a bar would be carriage-return noise, so the same
progress is a few plain lines instead: one per tenth of the total (and a last one), each
readable alone::

    download images.tar.gz: 81.3/162.6 MiB (50%)
    sweep multirun/smoke/x: 3/8 runs done (38%)
    reproduce [2/5] build the replay plan

The training loop's :class:`EpochBar` is a bar on a terminal and nothing elsewhere (the
log's epoch lines say the same).

Closes: torn log lines. A bar is a line redrawn in place with ``\r``; a log record written
to the same terminal while it is drawn lands after the bar's last frame, on its line
(``0it [00:00, ?it/s][...] logging to ...``). While any bar is open, :func:`logs_above_bars`
sends the console handlers of the ``reprotrain`` and root loggers through tqdm's
``logging_redirect_tqdm``: each record lifts the bars off the screen, is written whole on
its own line, and the bars are redrawn below it. A bar opens only when its work starts (no
empty ``0it`` frame) and closes by erasing its last frame (``leave=False``).

Progress never changes what is computed: it only reads counts the caller already has, draws
from no random stream, and reads the loss from the device once per ``every`` steps, only
on a terminal.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TextIO, TypeVar

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

MIB = 1024 * 1024
T = TypeVar("T")


def on_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False


#: The loggers whose console handlers a bar redirects: the framework's and the root (Hydra's
#: console handler; a user's loggers propagate to it).
REDIRECTED = ("reprotrain", "")


def _writes_to_console(handler: logging.Handler) -> bool:
    """What ``logging_redirect_tqdm`` replaces: a stream handler on sys.stdout/sys.stderr."""
    return isinstance(handler, logging.StreamHandler) and handler.stream in (
        sys.stdout,
        sys.stderr,
    )


@contextlib.contextmanager
def logs_above_bars() -> Iterator[None]:
    """While inside, log records to the terminal go through ``tqdm.write``: whole lines above
    the open bars, never on a bar's line. Only loggers that have a console handler are
    redirected (tqdm would add a handler to the others, doubling their records), and the
    stand-in keeps its handler's level and filters; file handlers are untouched."""
    console: dict[logging.Logger, logging.Handler] = {}
    for logger in map(logging.getLogger, REDIRECTED):
        first = next((h for h in logger.handlers if _writes_to_console(h)), None)
        if first is not None:  # the one tqdm copies formatter, stream and filters from
            console[logger] = first
    with logging_redirect_tqdm(loggers=list(console)):
        for logger, original in console.items():
            logger.handlers[-1].setLevel(original.level)  # tqdm's stand-in, appended last
        yield


class _OpenBar:
    """One tqdm bar on ``stream`` and the redirect that lasts exactly as long as it."""

    def __init__(self, stream: TextIO, **options: Any) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(logs_above_bars())
        try:
            self.tqdm = tqdm(file=stream, leave=False, dynamic_ncols=True, **options)
        except BaseException:
            self._stack.close()
            raise

    def close(self) -> None:
        """Erase the last frame (``leave=False``), then give the console handlers back."""
        try:
            self.tqdm.close()
        finally:
            self._stack.close()


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
        self._bar: _OpenBar | None = None
        if on_terminal(self._stream):
            self._bar = _OpenBar(
                self._stream,
                total=self.total,
                desc=what,
                unit="B" if in_bytes else (unit or "it"),
                unit_scale=in_bytes,
                unit_divisor=1024 if in_bytes else 1000,
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
            self._bar.tqdm.update(n)
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
            self._bar = None
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


def _rank() -> int:
    """This process's rank once torch.distributed is initialised, else 0."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return 0


class EpochBar:
    """The epoch's progress bar with the running loss, on a terminal only (elsewhere the
    epoch lines of the log say the same). The loss shown is the mean of the last ``every``
    steps: one host read every ``every`` steps, never one per step.

    The bar opens at an epoch's first step (``start``), not before: no ``0it`` frame above
    the run's first lines. It closes itself after the epoch's last step, erasing its last
    frame, so the epoch's log line is never drawn beside a 100% bar; ``close`` (idempotent)
    ends one a stop or an error left open. While it is open, log records go above it
    (:func:`logs_above_bars`). ``epochs``: the run's length, shown as ``epoch k/N``.

    An evaluation draws its own bar in the same place (:meth:`evaluating`), one batch at a
    time, counted on the host: no read from the device.
    """

    def __init__(
        self,
        enabled: bool,
        every: int = 10,
        stream: TextIO | None = None,
        epochs: int | None = None,
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        # One bar per job: torchrun's ranks share the terminal, and two bars would tear.
        self.enabled = bool(enabled) and on_terminal(self._stream) and _rank() == 0
        self.every = every
        self.epochs = epochs
        self._bar: _OpenBar | None = None

    @property
    def is_open(self) -> bool:
        return self._bar is not None

    def start(self, epoch: int, total: int, done: int) -> None:
        """Epoch ``epoch`` of ``total`` steps, ``done`` of them already run (a resume)."""
        self.close()
        if self.enabled and done < total:
            of = f"/{self.epochs}" if self.epochs else ""
            self._bar = _OpenBar(self._stream, total=total, initial=done, desc=f"epoch {epoch}{of}")

    def step(self, progress: Any, global_step: int) -> None:
        """One step done; every ``every`` global steps, the mean loss of the last ones."""
        if self._bar is None:
            return
        bar = self._bar.tqdm
        bar.update(1)
        if bar.total is not None and bar.n >= bar.total:
            self.close()  # the epoch's steps are done: no 100% frame beside its log line
        elif global_step % self.every == 0 and progress.step_losses:
            import torch  # here: the tools import this module and must start without torch

            recent = torch.stack(progress.step_losses[-self.every :]).float().mean()
            bar.set_postfix(loss=f"{recent.item():.4g}")

    def evaluating(self, split: str, batches: Iterable[T], total: int | None = None) -> Iterable[T]:
        """``batches`` of an evaluation of ``split`` (``total`` of them, when known), with a
        bar on a terminal; off a terminal, ``batches`` themselves (nothing added)."""
        return self._counted(split, batches, total) if self.enabled else batches

    def _counted(self, split: str, batches: Iterable[T], total: int | None) -> Iterator[T]:
        self.close()
        for batch in batches:
            if self._bar is None:  # opens with the first batch: no empty frame
                self._bar = _OpenBar(self._stream, total=total, desc=split, unit="batch")
            yield batch
            if self._bar is not None:
                self._bar.tqdm.update(1)
        self.close()  # erased before the line that reports the evaluation

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()

    def __enter__(self) -> EpochBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
