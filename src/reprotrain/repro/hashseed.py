"""PYTHONHASHSEED: the one control that only works at interpreter start.

Closes: str/bytes hash randomisation, which changes set and dict-of-set iteration order
between processes (and so anything built by iterating a set of strings). Python reads the
variable once at start-up, so a running interpreter cannot fix it: ``ensure`` re-execs the
current command with the variable set (Make and the Dockerfile also export it).
"""

from __future__ import annotations

import os
import sys

FIXED_VALUE = "0"


def ensure(argv: list[str] | None = None) -> None:
    """Re-exec this interpreter with PYTHONHASHSEED fixed, unless it already is.

    A numeric value chosen by the user is kept (and recorded); unset or ``random`` is
    replaced by ``FIXED_VALUE``. Also sets CUBLAS_WORKSPACE_CONFIG before torch is imported.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if os.environ.get("PYTHONHASHSEED", "random").isdigit():
        return
    os.environ["PYTHONHASHSEED"] = FIXED_VALUE
    args = argv if argv is not None else sys.argv
    sys.stdout.flush()
    sys.stderr.flush()
    if args and args[0] == "-c":  # `python -c`: nothing to re-exec; children inherit the value
        return
    os.execv(sys.executable, [sys.executable, *_module_argv(args)])


def _module_argv(args: list[str]) -> list[str]:
    """Rebuild the command line: ``python -m pkg.mod args`` keeps its ``-m`` form."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        return ["-m", name, *args[1:]]
    return list(args)
