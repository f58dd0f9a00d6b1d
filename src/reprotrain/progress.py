"""Progress of a long operation: a tqdm bar on a terminal, plain lines everywhere else.

Off a terminal, one line per tenth (``download images.tar.gz: 81.3/162.6 MiB (50%)``).

Closes: torn log lines: while a bar is open, console log records go through tqdm's
``logging_redirect_tqdm`` (docs/seeing-a-run.md). Progress reads counts only; no RNG.
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


#: The loggers whose console handlers a bar redirects (the root: Hydra's; a user's propagate).
REDIRECTED = ("reprotrain", "")


def _writes_to_console(handler: logging.Handler) -> bool:
    """What ``logging_redirect_tqdm`` replaces: a stream handler on sys.stdout/sys.stderr."""
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr)


@contextlib.contextmanager
def logs_above_bars() -> Iterator[None]:
    """Log records to the terminal go through ``tqdm.write``, above the open bars; only
    loggers with a console handler (else tqdm adds one), keeping its level and filters."""
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


def say(line: str) -> None:
    """A progress line on the ``sys.stdout`` of the moment (stderr keeps a refusal's line)."""
    print(line, flush=True)


class Progress:
    """``what: done/total unit (pct%)``: a tqdm bar on a terminal, else a line per tenth
    (``in_bytes``: shown in MiB; ``emit``: where lines go, e.g. a run's logger)."""

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
        self._emit = emit or (lambda line: print(line, file=self._stream, flush=True))
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
    """Numbered phases of one operation, as lines (a child's bar would tear a bar of ours)."""

    def __init__(self, what: str, names: Sequence[str], *, emit: Callable[[str], None]) -> None:
        self.what, self.names, self._emit = what, list(names), emit

    def __call__(self, name: str) -> None:
        """Announce phase ``name`` (one of ``names``)."""
        self._emit(f"{self.what} [{self.names.index(name) + 1}/{len(self.names)}] {name}")


def _rank() -> int:
    """This process's rank once torch.distributed is initialised, else 0."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return 0


class EpochBar:
    """The epoch's bar on a terminal only, with the mean loss of the last ``every`` steps
    (one host read per ``every``); opens at the first step, erases itself after the last."""

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
        self.every, self.epochs = every, epochs
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
        """``batches`` of an evaluation of ``split`` with a bar (counted on the host)."""
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
