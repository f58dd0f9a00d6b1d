"""The one rule for when two environments may promise identical bits.
Closes: false bitwise promises and false alarms. Resume and reproduce both ask
``differences(recorded, current)``; empty: the same code and config can give the same bits
here. What is compared, what is only a note, and why: docs/gpus.md. When in doubt a field is
compared; a field a record lacks is "not recorded" and differs, one recorded None matches None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reprotrain.repro.environment import GPU_ENV_VARS, steers_bits
from reprotrain.repro.machine import DISPATCH_ENV_VARS
from reprotrain.repro.precision import SETTINGS as FP32_SETTINGS
from reprotrain.run.schema import lookup

MISSING: Any = type("NotRecorded", (), {"__repr__": lambda self: "not recorded"})()

Getter = Callable[[dict], Any]


def _get(*path: str) -> Getter:
    return lambda env: lookup(env, path, MISSING)


device_type = _get("device", "type")


def cpu_model(env: dict) -> Any:
    """``AuthenticAMD AMD EPYC (family 25, model 17)``: the CPU model the rule compares."""
    cpu = _get("cpu")(env)
    if not isinstance(cpu, dict) or "vendor" not in cpu:
        return MISSING
    fields = [cpu.get(k) for k in ("vendor", "model_name", "family", "model")]
    if not any(fields):
        return None  # nothing known about this CPU (not Linux): matches only another unknown
    vendor, name, family, model = fields
    return f"{vendor} {name} (family {family}, model {model})"


def cpu_dispatch(env: dict) -> Any:
    """``portable`` or ``native``: whether the run's CPU dispatch was pinned (read back)."""
    value = _get("cpu", "portable")(env)
    return value if value is MISSING else ("portable" if value is True else "native")


#: (label, getter): compared on every run.
RULE: tuple[tuple[str, Getter], ...] = (
    ("device type", device_type),
    ("world size", _get("world_size")),
    ("torch", _get("torch")),
    ("python", _get("python")),
    ("numpy", _get("numpy")),
    ("machine", _get("machine")),
    ("thread count", _get("num_threads")),
)
#: (label, getter): compared on every run: the code paths chosen, and what steers them.
CPU_DISPATCH_RULE: tuple[tuple[str, Getter], ...] = (
    ("cpu dispatch", cpu_dispatch),
    ("cpu capability", _get("cpu", "capability")),
    ("oneDNN ISA", _get("cpu", "onednn_isa")),
    ("oneDNN enabled", _get("cpu", "mkldnn_enabled")),
    ("MKL CNR branch", _get("cpu", "mkl_cbwr_branch")),
    ("MKL", _get("cpu", "mkl_version")),
    ("oneDNN", _get("cpu", "onednn_version")),
    *((f"${name}", _get("cpu", "dispatch_env", name)) for name in DISPATCH_ENV_VARS),
)
#: (label, getter): the CPU model; not compared when both runs are portable.
CPU_MODEL_RULE: tuple[tuple[str, Getter], ...] = (
    ("CPU", cpu_model),
    ("cpu ISA extensions", _get("cpu", "isa_flags")),
)
#: (label, getter): compared when both runs are on CUDA.
CUDA_RULE: tuple[tuple[str, Getter], ...] = (
    ("gpu model", _get("gpu", "name")),
    ("gpu SM count", _get("gpu", "sm_count")),
    ("driver", _get("gpu", "driver_version")),
    ("driver CUDA version", _get("gpu", "driver_cuda_version")),
    ("CUDA", _get("cuda")),
    ("cuDNN", _get("cudnn")),
    ("BLAS library", _get("gpu", "blas_library")),
    ("cuBLAS workspace bytes", _get("gpu", "cublas_workspace_bytes")),
    ("cuBLASLt workspace bytes", _get("gpu", "cublaslt_workspace_bytes")),
    *((f"${name}", _get("gpu_env", name)) for name in GPU_ENV_VARS),
    ("fp16 reduced-precision reduction", _get("matmul", "fp16_reduced_precision_reduction")),
    ("bf16 reduced-precision reduction", _get("matmul", "bf16_reduced_precision_reduction")),
)
#: Variables the rule compares on their own: not named twice by the family comparison.
_RULED = frozenset((*DISPATCH_ENV_VARS, *GPU_ENV_VARS))
#: (label, getter): shown, never a reason on its own.
NOTES: tuple[tuple[str, Getter], ...] = (
    ("os", _get("os")),
    ("gpu", _get("gpu", "index")),
    ("gpu uuid", _get("gpu", "uuid")),
    ("visible gpus", _get("gpu", "visible_devices")),
    ("mig mode", _get("gpu", "mig_mode")),
    ("gpu memory", _get("gpu", "total_memory_bytes")),
    ("cpu stepping", _get("cpu", "stepping")),
)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return "none" if value is None else repr(value) if value is MISSING else str(value)


def both_portable(recorded_env: dict, current_env: dict) -> bool:
    """Both runs read back the portable CPU paths: the CPU model does not decide the bits."""
    return cpu_dispatch(recorded_env) == cpu_dispatch(current_env) == "portable"


def _compare(rules, recorded: dict, current: dict, missing_differs: bool = True) -> list[str]:
    out = []
    for label, get in rules:
        a, b = get(recorded), get(current)
        if (a is MISSING or b is MISSING) and not (missing_differs and a is not b):
            continue
        if isinstance(a, list) and isinstance(b, list) and a != b:
            gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            out.append(f"{label}: " + " ".join([*(f"-{x}" for x in gone), *(f"+{x}" for x in new)]))
        elif a is MISSING or b is MISSING or a != b:
            out.append(f"{label}: {_show(a)} -> {_show(b)}")
    return out


def differences(
    recorded_env: dict, current_env: dict, world_size_invariant: bool = False
) -> list[str]:
    """What rules out identical bits between two ``environment.capture()`` dicts, as
    one-liners ``"gpu model: NVIDIA H100 -> NVIDIA A100"`` (a ``world_size_invariant`` run:
    the world size not compared)."""
    recorded_env, current_env = recorded_env or {}, current_env or {}
    rule = [r for r in RULE if not (world_size_invariant and r[0] == "world size")]
    if not both_portable(recorded_env, current_env):
        rule += CPU_MODEL_RULE
    rule += CPU_DISPATCH_RULE
    out = _compare(rule, recorded_env, current_env)
    if device_type(recorded_env) == "cuda" and device_type(current_env) == "cuda":
        out += _compare(CUDA_RULE, recorded_env, current_env)
    return out + _bits_env_differences(recorded_env, current_env, steering=True)


def precision_difference(recorded_repro: dict | None, current_repro: dict | None) -> str | None:
    """One line when two runs' float math differs (run.json ``repro``): ``trainer.precision``,
    else any of torch's fp32_precision settings it was read back as; None when the same."""
    a, b = recorded_repro or {}, current_repro or {}
    rule = [("precision", _get("precision"))]
    if _get("precision")(a) == _get("precision")(b):  # else the settings follow from it
        rule += [(f"fp32_precision {k}", _get("fp32_precision", k)) for k in FP32_SETTINGS]
    found = _compare(rule, a, b)
    return f"{'; '.join(found)} (trainer.precision): not the same float math" if found else None


def _bits_env_differences(recorded_env: dict, current_env: dict, steering: bool) -> list[str]:
    """``$NAME: a -> b`` for each differing variable of ``bits_env`` that steers the bits
    (``steering``) or not; a record without them says "not recorded"."""
    a, b = recorded_env.get("bits_env"), current_env.get("bits_env")
    if a is None or b is None:
        return ["variables steering the kernels: not recorded"] if steering and a is not b else []
    return [
        f"${n}: {_show(a.get(n))} -> {_show(b.get(n))}"
        for n in sorted(set(a) | set(b))
        if a.get(n) != b.get(n) and steers_bits(n) == steering and n not in _RULED
    ]


def notes(recorded_env: dict, current_env: dict) -> list[str]:
    """Differences worth showing that do not affect the bits."""
    recorded_env, current_env = recorded_env or {}, current_env or {}
    notes_rule = NOTES + (CPU_MODEL_RULE if both_portable(recorded_env, current_env) else ())
    out = _compare(notes_rule, recorded_env, current_env, missing_differs=False)
    rvars, cvars = recorded_env.get("env") or {}, current_env.get("env") or {}
    for name in sorted((set(rvars) | set(cvars)) - set(GPU_ENV_VARS) - set(DISPATCH_ENV_VARS)):
        if rvars.get(name) != cvars.get(name):
            out.append(f"${name}: {_show(rvars.get(name))} -> {_show(cvars.get(name))}")
    shown = {line.split(":", 1)[0] for line in out}
    extra = _bits_env_differences(recorded_env, current_env, steering=False)
    return out + [line for line in extra if line.split(":", 1)[0] not in shown]


def cpu_key(env: dict) -> dict[str, str]:
    """What decides a run's CPU bits, by the rule's labels (pinned-hash tests are keyed by it)."""
    env = env or {}
    portable = cpu_dispatch(env) == "portable"
    host = tuple(r for r in RULE if r[0] in ("machine", "thread count"))
    rule = host + (CPU_DISPATCH_RULE if portable else CPU_MODEL_RULE + CPU_DISPATCH_RULE)
    return {label: _show(get(env)) for label, get in rule}


def _container_base(container: dict | None) -> str:
    if not container:
        return "none (not in a container)"
    base, base_id = container.get("base") or "not recorded", container.get("base_id")
    return f"{base} ({base_id})" if base_id else f"{base} (ID not recorded)"


def container_differences(recorded_run: dict, current_run: dict) -> list[str]:
    """``container base: A -> B`` when two runs (run.json dicts, ``container``) ran on
    different container bases, or one in a container and one outside: another libc, another
    Python build, other system libraries. Identical bits are not promised there, nor ruled out:
    the caller names it as the reason only when the bits differ (docs/container.md). A base whose
    ID was not recorded equals nothing (its tag may hold other packages by now); a record from
    before containers were recorded is not compared."""
    if "container" not in recorded_run or "container" not in current_run:
        return []
    a, b = _container_base(recorded_run["container"]), _container_base(current_run["container"])
    named = [(c or {}).get("base") for c in (recorded_run["container"], current_run["container"])]
    if a == b and ("(ID not recorded)" not in a or named == [None, None]):
        return []  # the same base, or none named on either side (not an image of ours)
    return [f"container base: {a} -> {b}: not promised the same bits (another libc or Python)"]
