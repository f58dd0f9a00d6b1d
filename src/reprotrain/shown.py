"""Text from a record or an archive, made safe to print on a terminal.

Closes: an archived string with newlines or ANSI escapes printing a fake line
(``REPRODUCED (bitwise)``) or hiding the rest (``ESC[8m``): every control, separator and
invisible format character becomes a visible escape, a backslash is doubled.
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
    """A line kept one line: control characters visible (a backslash kept), cut at ``limit``."""
    return _cut(_escaped(str(text), keep="\\"), limit)


def say(text: Any = "", file: TextIO | None = None, flush: bool = False) -> None:
    """``print`` one line through :func:`safe_line`."""
    print(safe_line(text), file=file or sys.stdout, flush=flush)


@contextmanager
def warnings_shown() -> Iterator[None]:
    """Warnings raised in the block (matplotlib names a character raw), printed once, escaped."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            yield
        finally:
            seen = dict.fromkeys((w.category.__name__, str(w.message)) for w in caught)
            for category, message in seen:  # each once, in the order first raised
                say(f"warning: {category}: {shown(message)}", file=sys.stderr)
