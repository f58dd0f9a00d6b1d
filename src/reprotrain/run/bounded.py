"""JSON and YAML from a run or an archive, parsed within bounds before anything trusts them.
Closes: a hostile document (an alias bomb, a recursive alias, deep nesting, a huge integer)
turning a reader into a stall or a traceback before any trust decision (docs/cli.md). The
bounds are far above what the trainer writes (a few hundred nodes, a 64-bit seed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from reprotrain.errors import RecordError

__all__ = ["MAX_DEPTH", "MAX_DIGITS", "MAX_NODES", "check_yaml", "load_json", "load_yaml"]
__all__ += ["MAX_BYTES", "read_json_lines"]

#: Nesting levels a record may have (lists and mappings).
MAX_DEPTH = 100
#: Digits of one integer (a 64-bit seed has 20).
MAX_DIGITS = 100
#: Nodes of a YAML document once its aliases are expanded.
MAX_NODES = 50_000
#: Bytes of a JSON-lines file read whole (an Optuna journal of 1,000 trials is about 2 MB).
MAX_BYTES = 256 * 2**20
_INT = "tag:yaml.org,2002:int"  # plain decimal, hex, octal, base 60, or tagged !!int


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _TooBig(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS})")
    return int(text)


class _TooBig(ValueError):
    """A bound was crossed (the message says which)."""


def _depth(value: Any) -> int:
    """How deep ``value`` nests lists and dicts (iterative: a deep value cannot recurse)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_DEPTH:
                return level
            todo += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def load_json(text: str | bytes, label: str) -> Any:
    """``json.loads`` within bounds (lenient on NaN); a syntax error stays ``JSONDecodeError``."""
    try:
        data = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError:
        raise  # the caller words a syntax error (it knows the file's role)
    except RecursionError:
        raise RecordError(_deep(label)) from None
    except ValueError as e:  # _TooBig, or Python's own int limit
        why = str(e).splitlines()[0]
        raise RecordError(f"{label}: {why}; not a record this tool wrote") from None
    if _depth(data) > MAX_DEPTH:
        raise RecordError(_deep(label))
    return data


def _deep(label: str) -> str:
    return f"{label}: nested more than {MAX_DEPTH} levels deep; not a record this tool wrote"


def check_yaml(text: str, label: str) -> None:
    """Refuse, in one ``RecordError`` line, a YAML node graph that is cyclic or crosses a bound
    (aliases counted each time they are used); composing is linear, nothing is expanded."""
    import yaml  # here, not at the top: make check-lock runs on the standard library alone

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise RecordError(_deep(label)) from None
    if root is None:
        return
    sizes: dict[int, int] = {}
    todo: list[tuple[Any, int, bool]] = [(root, 1, False)]
    open_nodes: set[int] = set()
    while todo:
        node, level, done = todo.pop()
        key = id(node)
        if done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > MAX_NODES:
                raise RecordError(
                    f"{label}: expands to more than {MAX_NODES:,} nodes through its aliases "
                    "(an alias bomb); not a record this tool wrote"
                )
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise RecordError(f"{label}: a recursive alias (a node contains itself)")
        if level > MAX_DEPTH:
            raise RecordError(_deep(label))
        if isinstance(node, yaml.ScalarNode):
            if node.tag == _INT and len(node.value.lstrip("+-")) > MAX_DIGITS:
                raise RecordError(
                    f"{label}: an integer of {len(node.value)} digits (at most {MAX_DIGITS}); "
                    "not a record this tool wrote"
                )
            sizes[key] = 1
            continue
        open_nodes.add(key)
        todo.append((node, level, True))
        todo += [(c, level + 1, False) for c in _children(node)]


def _children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def load_yaml(text: str, label: str) -> Any:
    """``yaml.safe_load`` after :func:`check_yaml`; a syntax error stays ``yaml.YAMLError``."""
    import yaml

    check_yaml(text, label)
    return yaml.safe_load(text)


def read_json_lines(path: Path, label: str) -> list[Any]:
    """Every line of a JSON-lines file (an Optuna journal), each a complete, UTF-8, bounded
    JSON document, or one ``RecordError`` line naming the first that is not (a torn write, a
    byte that is not UTF-8): what would otherwise surface as a ``UnicodeDecodeError`` deep in
    the reader, or a journal the next append silently corrupts."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise RecordError(f"{label}: cannot be read ({e.strerror or e})") from None
    if len(data) > MAX_BYTES:
        raise RecordError(f"{label}: larger than {MAX_BYTES:,} bytes; not a record this tool wrote")
    out = []
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        where = f"{label} line {number}"
        try:
            if not line.endswith(b"\n"):
                raise ValueError("it ends without a newline")
            out.append(load_json(line.decode("utf-8"), where))
        except (UnicodeDecodeError, ValueError) as e:
            why = "not UTF-8" if isinstance(e, UnicodeDecodeError) else str(e).splitlines()[0]
            raise RecordError(
                f"{where} is torn or damaged ({why}); restore the file (e.g. from its archive)"
            ) from None
    return out
