"""Compare two run directories bit for bit: per-epoch fingerprints, then final weights.

The loss of step ``s`` is computed before update ``s``, so a differing loss pins the
divergence to that step or the one before; :func:`with_metrics` holds the records to the same
standard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotrain.quoting import flatten
from reprotrain.run.readers import parse_json_object, read_config
from reprotrain.run.record import FINGERPRINTS, METRICS, RESOLVED_CONFIG, RUN_JSON, read_jsonl
from reprotrain.shown import shown

TIMING_KEYS = ("seconds", "images_per_s")
#: Config keys that say where or how a run is shown, not what it computes.
NOT_COMPUTED = ("resume", "trainer.progress", "name")
#: What run.json says ran beside the config: the seeds drawn, the controls in force.
IN_EFFECT = ("seeds", "repro")


def config_differences(a: Path, b: Path) -> dict[str, tuple[Any, Any]]:
    """Every setting two runs differ in, said even where their bits agree: each key of the
    resolved configs (where and how a run is shown aside) and, from run.json, the seeds that
    ran and the controls in force (``run.json repro.*``: the float math a precision sets,
    threads, the determinism flags)."""
    from omegaconf import OmegaConf

    flat = []
    for run in (a, b):
        config = OmegaConf.to_container(read_config(run / RESOLVED_CONFIG), resolve=False)
        record = _record(run / RUN_JSON)
        ran = {f"run.json {key}": record.get(key) or {} for key in IN_EFFECT}
        flat.append(flatten(config) | flatten(ran))
    fa, fb = flat
    keys = sorted((k for k in set(fa) | set(fb) if not k.startswith(NOT_COMPUTED)),
                  key=lambda k: (k.startswith("run.json"), k))  # fmt: skip
    found = {k: (fa.get(k), fb.get(k)) for k in keys if fa.get(k) != fb.get(k)}
    said = {f"run.json {k}" for k, v in found.items() if found.get(f"run.json {k}") == v}
    return {k: v for k, v in found.items() if k not in said}  # repro.num_threads said once


def differences_text(differences: dict[str, tuple[Any, Any]]) -> str:
    """``trainer.precision ('32-true' vs 'tf32'), ...``: each setting with its two values."""
    return ", ".join(f"{k} ({shown(repr(va), 40)} vs {shown(repr(vb), 40)})"
                     for k, (va, vb) in differences.items())  # fmt: skip


@dataclass
class Comparison:
    identical: bool
    epochs_compared: int
    divergent_epoch: int | None = None
    divergent_step: int | None = None
    reasons: list[str] = field(default_factory=list)
    metric_diffs: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)

    def verdict(self) -> str:
        if self.identical:
            return f"IDENTICAL: {self.epochs_compared} epoch(s) and final weights match bit for bit"
        where = f"epoch {self.divergent_epoch}" if self.divergent_epoch else "final weights"
        if self.divergent_step is not None:
            where += f" (step {self.divergent_step})"
        return f"DIVERGED at {where}: " + "; ".join(self.reasons)

    def diverged(self, reason: str) -> Comparison:
        """Not identical, for ``reason``."""
        self.identical = False
        self.reasons.append(reason)
        return self


def metric_differences(a: list[dict], b: list[dict]) -> dict[int, dict[str, tuple[float, float]]]:
    """{epoch: {metric: (a, b)}} for every metric that differs, timings aside."""
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for i, (ra, rb) in enumerate(zip(a, b, strict=False)):
        diff = {
            k: (ra.get(k), rb.get(k))
            for k in sorted(set(ra) | set(rb))
            if k not in TIMING_KEYS and ra.get(k) != rb.get(k)
        }
        if diff:
            epoch = ra.get("epoch")
            out[epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else i] = diff
    return out


def _field_text(name: str, a: object, b: object) -> str:
    return f"{shown(name)} {shown(a, 40)} vs {shown(b, 40)}"


def with_metrics(result: Comparison, a: Path, b: Path, epochs: int | None = None) -> Comparison:
    """Equal weights but a differing metrics row or ``final_metrics``: diverged at that field."""
    if not result.identical:
        return result
    rows = [len(read_jsonl(Path(d) / METRICS)) for d in (a, b)]
    if epochs is None and rows[0] != rows[1]:
        return result.diverged(f"weights match but {METRICS} has {rows[0]} vs {rows[1]} rows")
    if result.metric_diffs:
        epoch = min(result.metric_diffs)
        diffs = result.metric_diffs[epoch]
        first = ", ".join(_field_text(k, *v) for k, v in list(diffs.items())[:3])
        result.divergent_epoch, where = epoch, f"epoch {epoch} of {METRICS}"
        return result.diverged(f"weights match but metrics differ ({first}; {where})")
    if epochs is not None:
        return result
    fa, fb = (_record(Path(d) / RUN_JSON).get("final_metrics") or {} for d in (a, b))
    if fa == fb:
        return result
    if not isinstance(fa, dict) or not isinstance(fb, dict):
        first = _field_text("final_metrics", fa, fb)
    else:
        keys = sorted(str(k) for k in {**fa, **fb} if fa.get(k) != fb.get(k))
        first = ", ".join(_field_text(k, fa.get(k), fb.get(k)) for k in keys[:3])
    return result.diverged(f"weights match but final_metrics differ: {first}")


def compare_runs(reference: Path, candidate: Path, epochs: int | None = None) -> Comparison:
    """Compare ``candidate`` against ``reference`` over the first ``epochs`` (default all)."""
    fa, fb = read_jsonl(Path(reference) / FINGERPRINTS), read_jsonl(Path(candidate) / FINGERPRINTS)
    ma, mb = read_jsonl(Path(reference) / METRICS), read_jsonl(Path(candidate) / METRICS)
    n = min(len(fa), len(fb)) if epochs is None else epochs
    result = Comparison(identical=True, epochs_compared=n)
    result.metric_diffs = metric_differences(ma[:n], mb[:n])
    if len(fa) < n or len(fb) < n or (epochs is None and len(fa) != len(fb)):
        result.diverged(f"epoch counts differ ({len(fa)} vs {len(fb)})")
    for ea, eb in zip(fa[:n], fb[:n], strict=False):
        if ea["weights_sha256"] != eb["weights_sha256"] or ea["step_losses"] != eb["step_losses"]:
            result.divergent_epoch = ea["epoch"]
            pairs = zip(ea["step_losses"], eb["step_losses"], strict=False)
            result.divergent_step = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
            wa, wb = ea["weights_sha256"][:12], eb["weights_sha256"][:12]
            return result.diverged(f"weights {wa} vs {wb}")
    if epochs is None and result.identical:
        ra, rb = (_record(Path(d) / RUN_JSON) for d in (reference, candidate))
        if ra.get("final_weights_sha256") != rb.get("final_weights_sha256"):
            result.diverged("final_weights_sha256 differs")
    return result


def _record(path: Path) -> dict:
    """run.json, parsed within bounds (run/bounded.py): a hostile one is one RecordError line."""
    return parse_json_object(path.read_text(), str(path))
