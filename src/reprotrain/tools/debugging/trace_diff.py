"""Compare two per-op traces of the same step (``repro/op_trace.py``): the first difference.

In order: the input batch (data order, augmentation); the ops dispatched (code path); the
first op whose output differs and whether its inputs already did (kernel, or state from
outside the step: ``make bisect`` walks back). docs/when-bits-differ.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from reprotrain.repro.op_trace import BATCH, compares_output

KERNEL = "a nondeterministic kernel, a different algorithm or a different reduction order"
OUTSIDE = "the difference came from before this step (weights, optimizer state or RNG)"
DATA = "data order (seed.data) or augmentation"


@dataclass
class Finding:
    """The first difference between two traces of ``step``; ``kind`` says which question."""

    step: int
    kind: str  # "batch" | "op sequence" | "output" | "length"
    index: int | None = None
    op: str | None = None
    module: str | None = None
    phase: str | None = None
    inputs_identical: bool | None = None
    other_op: str | None = None

    def cause(self) -> str:
        if self.kind == "batch":
            return DATA
        if self.kind in ("op sequence", "length"):
            return "a different code path (config, algorithm choice or library version)"
        return KERNEL if self.inputs_identical else OUTSIDE

    def sentence(self) -> str:
        if self.kind == "batch":
            return f"step {self.step}: the batch differs -> {self.cause()}"
        if self.kind == "op sequence":
            return (
                f"step {self.step}: the ops differ at op {self.index}: {self.op} vs "
                f"{self.other_op} in {self.module} ({self.phase}) -> {self.cause()}"
            )
        if self.kind == "length":
            return f"step {self.step}: one run dispatches more ops after op {self.index}"
        inputs = "inputs identical" if self.inputs_identical else "inputs already differed"
        return (
            f"step {self.step}: first difference in {self.module} ({self.op}, {self.phase}), "
            f"{inputs} -> {self.cause()}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cause": self.cause(), "sentence": self.sentence()}


def first_difference(step: int, a: list[dict], b: list[dict]) -> Finding | None:
    """None when the two traces hash the same everywhere."""
    if not a or not b or a[0]["op"] != BATCH or b[0]["op"] != BATCH:
        raise ValueError("a trace must start with its batch row")
    if a[0]["outputs"] != b[0]["outputs"]:
        return Finding(step, "batch")
    for ra, rb in zip(a[1:], b[1:], strict=False):
        where = {"index": ra["index"], "module": ra["module"], "phase": ra["phase"]}
        if ra["op"] != rb["op"]:
            return Finding(step, "op sequence", op=ra["op"], other_op=rb["op"], **where)
        if compares_output(ra["op"]) and ra["outputs"] != rb["outputs"]:
            same_inputs = ra["inputs"] == rb["inputs"]
            return Finding(step, "output", op=ra["op"], inputs_identical=same_inputs, **where)
    if len(a) != len(b):
        return Finding(step, "length", index=min(len(a), len(b)) - 2)
    return None


def first_digest_difference(
    steps: range, a: dict[int, dict], b: dict[int, dict]
) -> tuple[int | None, list[int]]:
    """(the first step whose batch or op digest differs or None, steps a replay did not digest)."""
    missing = [s for s in steps if s not in a or s not in b]
    for s in (s for s in steps if s not in missing):
        ra, rb = a[s], b[s]
        if (ra["batch"], ra["ops"], ra["digest"]) != (rb["batch"], rb["ops"], rb["digest"]):
            return s, missing
    return None, missing
