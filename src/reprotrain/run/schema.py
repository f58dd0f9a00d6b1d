"""The one schema of run.json, checked by every reader (docs/archive-and-reproduce.md).
Closes: a record that contradicts itself being archived and replayed, or crashing a tool
with a traceback. Each field has one form, checked where present (unknown keys are kept);
what a use needs on top (a replay: ``seeds.base``, ``repro.level``) is asked with ``required``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from reprotrain.errors import RecordError
from reprotrain.run.record import STATUSES

HINT = "the record contradicts itself (was it edited?); restore it from a copy or re-run"
STREAMS = ("init", "data", "augment", "train")  # the seed streams besides ``seeds.base``


@dataclass(frozen=True)
class Form:
    """What a field must be (``what``, for the message) and the test for it."""

    what: str
    ok: Callable[[Any], bool]


def _is_int(v: Any, low: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)


def _nullable(form: Form) -> Form:
    return Form(f"{form.what} or null", lambda v: v is None or form.ok(v))


def _mapping(values: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: (
        isinstance(v, dict) and all(isinstance(k, str) and values(x) for k, x in v.items())
    )


OBJECT = Form("an object", lambda v: isinstance(v, dict))
STRING = Form("a string", lambda v: isinstance(v, str))
BOOL = Form("true or false", lambda v: isinstance(v, bool))
COUNT = Form("an integer >= 0", lambda v: _is_int(v, 0))
POSITIVE = Form("a positive integer", lambda v: _is_int(v, 1))
INTEGER = Form("an integer", _is_int)
LEVEL = Form(
    "a level name (strict, warn, fast, portable, ...)",
    lambda v: isinstance(v, str) and re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", v) is not None,
)
PRECISION = Form(
    "a precision name (32-true, tf32, bf16-mixed, 16-mixed, ...)",
    lambda v: isinstance(v, str) and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,31}", v) is not None,
)
HASHSEED = Form(
    "an integer in 0..4294967295",
    lambda v: (_is_int(v, 0) and v <= 4294967295) or (isinstance(v, str) and v.isdigit()),
)
STATUS = Form(f"one of {', '.join(STATUSES)}", lambda v: v in STATUSES)
VARIABLES = Form(
    "an object of {variable name: string or null}",
    _mapping(lambda x: x is None or isinstance(x, str)),
)


def _list_of(item_type: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(isinstance(x, item_type) for x in v)


STRINGS = Form("a list of strings", _list_of(str))
DIGESTS = Form("an object of {file: sha256}", _mapping(lambda x: isinstance(x, str)))
OBJECTS = Form("a list of objects", _list_of(dict))
NESTED = Form("an object of objects", _mapping(lambda x: isinstance(x, dict)))

#: dotted key -> its form, checked when the key is present (parents first).
FIELDS: dict[str, Form] = {
    "status": STATUS,
    "experiment_id": _nullable(STRING),
    "seeds": OBJECT,
    "seeds.base": INTEGER,
    "seeds.source": _nullable(STRING),
    **{f"seeds.{s}": _nullable(INTEGER) for s in STREAMS},
    "repro": OBJECT,
    "repro.level": LEVEL,
    "repro.precision": PRECISION,
    "repro.pythonhashseed": _nullable(HASHSEED),
    "world_size": POSITIVE,
    "ranks": OBJECTS,
    "world_size_invariant": _nullable(BOOL),
    "environment": _nullable(OBJECT),
    "environment.gpu_env": _nullable(VARIABLES),
    "environment.env": _nullable(VARIABLES),
    "environment.device": _nullable(OBJECT),
    "environment.world_size": _nullable(POSITIVE),
    "environment.num_threads": _nullable(POSITIVE),
    "git": _nullable(OBJECT),
    "git.commit": _nullable(STRING),
    "git.dirty": _nullable(BOOL),
    "git.fully_archivable": _nullable(BOOL),
    "git.not_archived": _nullable(STRINGS),
    "code_sha256": _nullable(STRING),
    "data_fingerprint": _nullable(OBJECT),
    "data_fingerprint.sha256": _nullable(STRING),
    "imported_code": _nullable(DIGESTS),
    "lock_sha256": _nullable(STRING),
    "epochs_completed": _nullable(COUNT),
    "resumes": OBJECTS,
    "nondeterministic_ops": STRINGS,
    "final_metrics": _nullable(OBJECT),
    "components": _nullable(OBJECT),
    "env_drift": _nullable(OBJECT),
    "env_interpolations": _nullable(NESTED),
}
#: The form of each key of a ``resumes`` entry, when present.
RESUME_FIELDS: dict[str, Form] = {
    "global_step": COUNT,
    "overrides": _nullable(NESTED),
    "mismatch": _nullable(STRINGS),
    "unrestored": _nullable(STRINGS),
    "bitwise_guarantee": _nullable(BOOL),
}
#: What ``make reproduce`` needs to replay a run.
REPLAY = ("seeds.base", "repro.level")
_MISSING = object()


def lookup(node: Any, path: Iterable[str], missing: Any = _MISSING) -> Any:
    """``node[path[0]][path[1]]...``, or ``missing`` where a key is absent (or not in a dict)."""
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return missing
        node = node[part]
    return node


def _wrong(key: str, value: Any, what: str) -> str:
    """``world_size 'two' is not a positive integer``; ``seeds is a str, not an object``."""
    if not what.startswith(("an object", "a list")):
        return f"{key} {repr(value)[:40]} is not {what}"
    scalar = value is None or isinstance(value, (bool, int, float))
    shown = repr(value)[:40] if scalar else f"a {type(value).__name__}"
    return f"{key} is {shown}, not {what}"


def _absent(key: str) -> str:
    integer = "integer " if FIELDS[key] is INTEGER else ""
    return f"no {integer}{key}; the record is incomplete"


def problems(record: Any, required: tuple[str, ...] = ()) -> list[str]:
    """Every way ``record`` is not a run.json (empty when it is one)."""
    if not isinstance(record, dict):
        return [_wrong("the record", record, "an object")]
    found = []
    for key, form in FIELDS.items():
        if (value := lookup(record, key.split("."))) is not _MISSING and not form.ok(value):
            found.append(_wrong(key, value, form.what))
    absent = [_absent(key) for key in required if lookup(record, key.split(".")) is _MISSING]
    return found + relations(record) + absent


def relations(record: dict) -> list[str]:
    """What two well-formed fields say against each other, and each resume entry's keys."""
    out = []
    ranks, world = record.get("ranks"), record.get("world_size")
    if isinstance(ranks, list) and _is_int(world) and len(ranks) != world:
        out.append(f"world_size {world} but {len(ranks)} rank(s) recorded")
    resumes = record.get("resumes")
    for i, entry in enumerate(resumes if isinstance(resumes, list) else []):
        for key, form in RESUME_FIELDS.items():
            if isinstance(entry, dict) and key in entry and not form.ok(entry[key]):
                out.append(_wrong(f"resumes[{i}].{key}", entry[key], form.what))
    return out


def check(record: Any, label: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """``record`` when it is a run.json with the ``required`` keys; else a one-line RecordError."""
    if found := problems(record, required):
        shown = "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
        edited = any(not p.endswith("incomplete") for p in found)
        raise RecordError(f"{label}: {shown}" + (f"; {HINT}" if edited else ""))
    return record
