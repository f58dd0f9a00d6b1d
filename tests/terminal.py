"""A terminal for tests: run a command on a pseudo-terminal, and the screen its output leaves.

``on_a_pty`` starts a command with stdout and stderr on one pty (as in a user's shell: both
streams are the same screen) and reads everything it writes. ``screen`` replays that output
the way a terminal does: ``\\r`` returns to the line's start, ``\\n`` moves down, printable
characters overwrite, ``ESC[K``/``ESC[2K`` erase, ``ESC[A``/``ESC[B`` move up and down. What
is left is what a user sees after the command ended: a bar's redraws collapse into its last
frame (or nothing, once it is erased), and a log record written onto a bar's line shows up
as one torn line.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def on_a_pty(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, columns: int = 120
) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr on a ``columns``-wide pty: (exit code, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    try:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
        )
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the pty
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def screen(output: str) -> list[str]:
    """The lines ``output`` leaves on a terminal (trailing blanks stripped)."""
    rows: list[list[str]] = [[]]
    row = col = 0
    pos = 0
    while pos < len(output):
        match = CSI.match(output, pos)
        if match:
            pos = match.end()
            args, command = match.group(1), match.group(2)
            n = int(args) if args.isdigit() else None
            line = rows[row]
            if command == "K":
                if n in (None, 0):
                    del line[col:]
                elif n == 1:
                    line[: col + 1] = [" "] * min(col + 1, len(line))
                else:
                    line.clear()
            elif command == "A":
                row = max(0, row - (n or 1))
            elif command == "B":
                row += n or 1
            elif command == "C":
                col += n or 1
            elif command == "D":
                col = max(0, col - (n or 1))
            elif command == "G":
                col = (n or 1) - 1
            while len(rows) <= row:
                rows.append([])
            continue
        char = output[pos]
        pos += 1
        if char == "\r":
            col = 0
        elif char == "\n":
            row += 1
            while len(rows) <= row:
                rows.append([])
        elif char == "\b":
            col = max(0, col - 1)
        elif char == "\t":
            col = (col // 8 + 1) * 8
        elif char == "\x1b" or ord(char) < 32:
            continue  # another escape or control character: no glyph
        else:
            line = rows[row]
            if len(line) < col:
                line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
    return ["".join(line).rstrip() for line in rows]
