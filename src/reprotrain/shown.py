"""Text from a record or an archive, made safe to print on a terminal.

Closes: an archived string (an ``experiment_id``, a job name, a metric key, a recorded
environment value, a path) that carries newlines and ANSI escapes and so prints a fake
line (``REPRODUCED (bitwise)``, ``trust (a) ... signed by ...``) and then hides the rest of
the output (``ESC[8m``). Nothing a command prints from a record reaches the terminal raw:

- :func:`shown` is one value: every control character (C0, DEL, C1), line or paragraph
  separator and invisible format character (bidi overrides, zero-width marks) becomes a
  visible escape (``\\n``, ``\\x1b``, ``\\u202e``); a backslash is doubled so an escape
  cannot be faked either; a value longer than ``limit`` is cut, saying how much was left.
- :func:`safe_line` is a whole line that must stay one line: the same escapes, no cut.
- :func:`say` prints a line through :func:`safe_line` (what reproduce, compare, bisect,
  report and summary print with).
- :func:`warnings_shown` catches the warnings a third-party library raises on values from a
  record (matplotlib's ``Glyph 27 (\x1b) missing`` names the character raw) and prints each
  as one escaped ``warning:`` line on stderr.

A multi-line text a command builds on purpose (a Markdown table) escapes each value with
:func:`shown` and keeps its own newlines.
"""

from __future__ import annotations

import sys
import unicodedata
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["LIMIT", "LINE_LIMIT", "safe_line", "say", "shown", "warnings_shown"]

#: Characters of one value shown before it is cut, and of one line.
LIMIT = 200
LINE_LIMIT = 2000
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _visible(ch: str, keep: str = "") -> str:
    if ch in keep:
        return ch
    if ch in _NAMED:
        return _NAMED[ch]
    if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"):
        code = ord(ch)
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    return ch


def _escaped(text: str, keep: str = "") -> str:
    if text.isprintable() and "\\" not in text:  # the common case: nothing to do
        return text
    return "".join(_visible(ch, keep) for ch in text)


def shown(value: Any, limit: int = LIMIT) -> str:
    """``value`` as one printable line: control characters visible, cut after ``limit``."""
    return _cut(_escaped(str(value)), limit)


def _cut(text: str, limit: int) -> str:
    return f"{text[:limit]}...(+{len(text) - limit} chars)" if len(text) > limit else text


def safe_line(text: Any, limit: int = LINE_LIMIT) -> str:
    """A line meant to be one line, with any control character in it made visible (a
    backslash is kept as it is: the values in it were escaped by :func:`shown`), cut after
    ``limit`` characters."""
    return _cut(_escaped(str(text), keep="\\"), limit)


def say(text: Any = "", file: TextIO | None = None, flush: bool = False) -> None:
    """``print`` one line through :func:`safe_line`."""
    print(safe_line(text), file=file or sys.stdout, flush=flush)


@contextmanager
def warnings_shown() -> Iterator[None]:
    """Warnings raised inside the block are printed once each on stderr through :func:`say`
    (``warning: Category: message``), escaped, instead of reaching the terminal raw."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            seen: set[tuple[str, str]] = set()
            for w in caught:
                key = (w.category.__name__, str(w.message))
                if key not in seen:
                    seen.add(key)
                    say(f"warning: {key[0]}: {shown(key[1])}", file=sys.stderr)
