"""Schemas of the project-owned config groups, registered in Hydra's ConfigStore (a misspelt
key or wrong type fails while Hydra composes); ``validate`` adds the range checks; ``trainer``
is split by concern into frozen settings. ``_target_`` groups: ``components.check``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from reprotrain.errors import ReprotrainError
from reprotrain.loggers import LoggerConfig, LoggerSettings, check_extras
from reprotrain.quoting import flatten
from reprotrain.repro.levels import LEVELS
from reprotrain.repro.precision import PRECISIONS


@dataclass
class SeedConfig:
    base: int | None = 42
    from_entropy: bool = False  # draw base from os.urandom and record it (seed=entropy)
    init: int | None = None
    data: int | None = None
    augment: int | None = None
    train: int | None = None  # per-stream overrides; null: derived from base


@dataclass
class ReproConfig:
    level: str = "strict"  # strict | warn | fast | portable (strict + x86-64-wide CPU paths)
    # CPU intra-op threads: cores // processes per node; recorded (they change reduction order)
    num_threads: int = II("cores_per_job:")
    fill_uninitialized_memory: bool = True  # see README: deterministic NaN fill of torch.empty
    require_locked_env: bool = False  # drift between .venv and the lock becomes fatal


def from_trainer(cls: type, trainer: Any) -> Any:
    """``cls`` (a frozen dataclass whose field names are ``trainer.*`` keys) from the config."""
    return cls(**{f.name: trainer[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class RunSettings:
    """Where the run trains, the checkpoints it keeps, what a resume may change."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps (mps: no bitwise promise)
    allow_device_change: bool = False  # resume on another device type (recorded: not bitwise)
    keep_checkpoints: int = 3
    allow_unrestored_state: bool = False  # resume despite unrestorable state (not bitwise)
    verify_resume: bool = True  # replay the last interval and compare bits (docs/resume.md)


@dataclass(frozen=True)
class PipelineSettings:
    """How the data pipeline serves batches: which path, how big, how shortened."""

    pipeline: str = "auto"  # auto: device for in-memory tensors, loader for file datasets
    num_workers: int = 0  # loader pipeline only; never changes the bits
    batch_size: int = 512  # global batch, samples per optimizer step
    eval_batch_size: int = 1024
    limit_train_steps: int = 0  # conf/debug/ (0: off): steps per epoch, the schedule spans them
    limit_eval_batches: int = 0  # batches per evaluation pass
    overfit_batches: int = 0  # every epoch repeats the first N batches of epoch 1


@dataclass(frozen=True)
class ReductionSettings:
    """How the ranks combine a step (``reduction.for_run``); may a resume change the world?"""

    world_size_invariant: bool = False  # same bits on any world size dividing microbatches
    sync_batchnorm: bool = False  # DDP: BatchNorm statistics over the global batch
    allow_world_size_change: bool = False  # resume under another world size (not bitwise)


@dataclass(frozen=True)
class LoopSettings:
    """What the epoch loop reads: length, evaluation cadence, the monitored value, stops."""

    epochs: int = 30
    eval_every: int = 1  # epochs between validation passes; the last epoch is always evaluated
    monitor: str = "val_acc"  # metrics.jsonl key that picks best.pt and is the sweep objective
    monitor_mode: str = "max"  # max | min
    checkpoint_every_steps: int = 0  # 0: only at epoch ends
    stop_at_global_step: int = 0  # checkpoint and exit 75 after this step (0: off)
    stop_after_epoch: int = 0  # end (completed) after this epoch, the schedule unchanged
    progress: bool = True  # tqdm bar; silenced automatically when stderr is not a TTY
    profile_steps: int = 0  # torch.profiler trace of N steps (after 1 warm-up) in the run dir


@dataclass(frozen=True)
class GuardSettings:
    """The non-finite guard: what a NaN/inf does, and how often the flag is read."""

    on_nonfinite: str = "stop"  # stop | warn: what a NaN/inf loss (or grad norm) does
    nonfinite_check_every: int = 10  # steps between host reads of the device's guard flag


@dataclass(frozen=True)
class ModelSettings:
    """How the model, its optimizer and its forward are built."""

    channels_last: bool = False  # NHWC memory format for model and batches
    compile: bool = False  # torch.compile the model (mode below); compile time is reported
    compile_mode: str = "default"
    no_decay_norm_bias: bool = False  # put biases and norm weights (ndim <= 1) in a wd=0 group
    amp_init_scale: float = 65536.0  # 16-mixed only: GradScaler's starting loss scale


@dataclass(frozen=True)
class StepSettings:
    """What one optimizer step needs: precision, clipping, the micro-batch size."""

    precision: str = "32-true"  # 32-true | tf32 | bf16-mixed | 16-mixed (repro/precision.py)
    grad_clip_norm: float = 0.0  # 0: off; else clip the global L2 norm (and guard it)
    microbatch_size: int | None = None  # samples per gradient-accumulation piece; None: one


@dataclass(frozen=True)
class TrainerSettings:
    """``trainer.*`` split by concern; each part goes to the component that reads it."""

    run: RunSettings
    pipeline: PipelineSettings
    reduction: ReductionSettings
    model: ModelSettings
    step: StepSettings
    loop: LoopSettings
    guard: GuardSettings

    @classmethod
    def from_config(cls, trainer: Any) -> TrainerSettings:
        parts = get_type_hints(cls)
        return cls(**{f.name: from_trainer(parts[f.name], trainer) for f in fields(cls)})


def trainer_schema() -> type:
    """The flat ``trainer`` group's schema, made from the settings' fields."""
    columns = []
    for part in get_type_hints(TrainerSettings).values():
        hints = get_type_hints(part)
        columns += [(f.name, hints[f.name], field(default=f.default)) for f in fields(part)]
    schema = make_dataclass("TrainerConfig", columns)
    schema.__module__ = __name__  # pickled by reference (submitit, joblib): config.TrainerConfig
    return schema


TrainerConfig = trainer_schema()


@dataclass
class TrainConfig:
    dataset: Any = MISSING
    model: Any = MISSING
    task: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    loss: Any = MISSING
    step: Any = field(default_factory=lambda: {"_target_": "reprotrain.step.PlainStep"})
    callbacks: Any = None  # names to _target_ nodes (conf/callbacks/); null: none
    sampler: Any = None  # a _target_ node (conf/sampler/); None: the framework's shuffle
    seed: SeedConfig = MISSING
    repro: ReproConfig = MISSING
    trainer: TrainerConfig = MISSING
    # Untracked paths whose contents may go into git.diff and archives (others: name, sha256)
    include_untracked: list[str] = field(default_factory=list)
    logger: Any = field(default_factory=lambda: asdict(LoggerConfig()))
    name: str = "run"  # experiment name, part of the run directory name
    resume: str | None = None  # null | auto | path/to/checkpoint.pt
    tags: list[str] = field(default_factory=list)  # labels for finding runs; not identity


PROJECT_GROUPS = {
    "seed": SeedConfig,
    "repro": ReproConfig,
    "trainer": TrainerConfig,
}
USER_GROUPS = ("dataset", "model", "task", "optimizer", "scheduler", "loss", "step")


def register_configs() -> None:
    """Register the schema for train.yaml and for each project-owned group."""
    from reprotrain import conf, launchers

    conf.register()  # the framework's wiring and its own job (src/reprotrain/conf)
    launchers.register_resolvers()  # ${cores_per_job:} is the default thread count
    cs = ConfigStore.instance()
    conf.store_once(cs, "train_schema", TrainConfig)
    # No logger group: typed through TrainConfig.logger: options are a mergeable list
    for group, node in PROJECT_GROUPS.items():
        conf.store_once(cs, f"{group}_schema", node, group)


def _keys(text: str) -> tuple[str, ...]:
    """The dotted keys in ``text``, separated by spaces."""
    return tuple(text.split())


CHOICES = {
    "repro.level": tuple(LEVELS),
    "trainer.pipeline": ("auto", "device", "loader"),
    "trainer.precision": PRECISIONS,
    "trainer.monitor_mode": ("max", "min"),
    "trainer.on_nonfinite": ("stop", "warn"),
}
POSITIVE = _keys(
    "trainer.epochs trainer.batch_size trainer.eval_batch_size trainer.eval_every "
    "trainer.keep_checkpoints trainer.nonfinite_check_every trainer.amp_init_scale "
    "repro.num_threads"
)
NON_NEGATIVE = _keys(
    "trainer.checkpoint_every_steps trainer.num_workers trainer.grad_clip_norm "
    "trainer.stop_after_epoch trainer.limit_train_steps trainer.limit_eval_batches "
    "trainer.overfit_batches trainer.profile_steps trainer.stop_at_global_step"
)
DEVICES = "auto, cpu, cuda, cuda:N, mps"
MAX_THREADS = 4096
SEED_MAX = (1 << 64) - 1  # seeds are 64-bit: torch.manual_seed refuses anything larger


def _non_finite_leaves(node: Any, prefix: str) -> list[str]:
    if isinstance(node, dict | DictConfig):
        return [k for key in node for k in _non_finite_leaves(node[key], f"{prefix}.{key}")]
    if isinstance(node, list | tuple) or (hasattr(node, "__iter__") and hasattr(node, "_iter_ex")):
        return [k for i, v in enumerate(node) for k in _non_finite_leaves(v, f"{prefix}[{i}]")]
    if isinstance(node, float) and not math.isfinite(node):
        return [prefix]
    return []


def validate(cfg: DictConfig | Any, world_size: int) -> None:
    """Range checks a type cannot express, and the batch layout on ``world_size`` ranks."""
    for key, allowed in CHOICES.items():
        if (value := OmegaConf.select(cfg, key)) not in allowed:
            raise ReprotrainError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    if not re.fullmatch(r"auto|cpu|mps|cuda(:[0-9]+)?", device := cfg.trainer.device):
        raise ReprotrainError(f"trainer.device={device!r} is not one of {DEVICES}")
    for key in POSITIVE:
        if not ((value := OmegaConf.select(cfg, key)) > 0 and math.isfinite(value)):
            raise ReprotrainError(f"{key}={value} must be a finite number > 0")
    for key in NON_NEGATIVE:
        if not ((value := OmegaConf.select(cfg, key)) >= 0 and math.isfinite(value)):
            raise ReprotrainError(f"{key}={value} must be a finite number >= 0")
    if cfg.repro.num_threads > MAX_THREADS:
        raise ReprotrainError(f"repro.num_threads={cfg.repro.num_threads} is above {MAX_THREADS}")
    if cfg.seed.base is None and not cfg.seed.from_entropy:
        raise ReprotrainError("seed.base is null; set seed.base=<int> or use seed=entropy")
    for stream in ("base", "init", "data", "augment", "train"):
        value = cfg.seed[stream]
        if value is not None and not 0 <= value <= SEED_MAX:
            raise ReprotrainError(f"seed.{stream}={value} must be an integer in [0, 2**64 - 1]")
    check_layout(cfg.trainer, world_size)
    check_callbacks(cfg.callbacks)
    check_extras(LoggerSettings.of(cfg.logger))
    for group in USER_GROUPS:
        if bad := _non_finite_leaves(cfg[group], group):
            raise ReprotrainError(f"{bad[0]} is not a finite number (nan/inf); give a real value")


def check_callbacks(node: Any) -> None:
    """Each ``callbacks`` entry is off (null) or a ``_target_`` node, before anything is
    written: ``+callbacks.early_stopping.patience=5`` (Hydra's hint) without picking the
    entry makes a node with no ``_target_``."""
    if node is not None and not isinstance(node, DictConfig):
        raise ReprotrainError("callbacks must be a mapping of names to _target_ nodes")
    for name, entry in (node or {}).items():
        if entry is not None and not (isinstance(entry, DictConfig) and "_target_" in entry):
            raise ReprotrainError(
                f"callbacks.{name} has no _target_: pick the entry first "
                f"(callbacks={name}, or a list: callbacks=[default,{name}]) and set its keys "
                f"as callbacks.{name}.<key>=<value>; your own: +callbacks.{name}._target_=..."
            )


def launch_world_size() -> int:
    """The world size the launcher announces (torchrun's ``WORLD_SIZE``; 1 without one)."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else 1


def check_workers(pipeline: str, num_workers: int, *, in_memory: bool, target: str) -> None:
    """Loader workers need the loader pipeline (``target``: the dataset, named)."""
    if not num_workers:
        return
    if pipeline == "device":
        raise ReprotrainError("trainer.num_workers needs trainer.pipeline=loader (or auto)")
    if pipeline == "auto" and in_memory is True:
        raise ReprotrainError(
            f"trainer.num_workers={num_workers} needs trainer.pipeline=loader: "
            f"{target} is in memory, and trainer.pipeline=auto serves it on the "
            "device, where workers have nothing to do; drop trainer.num_workers or add "
            "trainer.pipeline=loader"
        )


def check_num_classes(given: int | None, actual: int | None) -> None:
    """``model.num_classes`` against the dataset's classes (None on either side: unknown)."""
    if given is not None and actual is not None and given != actual:
        raise ReprotrainError(
            f"model.num_classes={given} but the dataset has {actual} classes; "
            f"set model.num_classes={actual}"
        )


def check_std(std: Any) -> None:
    """A normalisation ``dataset.std`` divides: every channel's must be > 0."""
    if min(std) <= 0:
        raise ReprotrainError(f"dataset.std={list(std)} must be > 0 in every channel")


def microbatches_per_step(batch_size: int, microbatch_size: int | None) -> int:
    """The step's global batch in micro-batches (1 when ``microbatch_size`` is null)."""
    return batch_size // (microbatch_size or batch_size)


def check_divisible(global_batch: int, world_size: int) -> None:
    """The global batch splits evenly over the ranks (``distributed.shard_global_batch``)."""
    if global_batch % world_size:
        raise ReprotrainError(
            f"trainer.batch_size={global_batch} (the global batch) is not divisible by the "
            f"world size {world_size}; pick a multiple of {world_size}"
        )


def check_layout(trainer: Any, world_size: int) -> None:
    """The one check of how a step's batch splits over ranks and into micro-batches."""
    batch, micro = trainer.batch_size, trainer.microbatch_size
    if micro is not None and not 0 < micro <= batch:
        raise ReprotrainError(
            f"trainer.microbatch_size={micro} must be in 1..trainer.batch_size "
            f"({batch}), or null for one piece per step"
        )
    if micro is not None and batch % micro:
        raise ReprotrainError(
            f"trainer.microbatch_size={micro} does not divide trainer.batch_size={batch}; "
            "pick a divisor"
        )
    check_divisible(batch, world_size)
    per_rank, k = batch // world_size, microbatches_per_step(batch, micro)
    if trainer.world_size_invariant and k % world_size:
        raise ReprotrainError(
            f"trainer.world_size_invariant needs the world size ({world_size}) to divide "
            f"the {k} micro-batch(es) per step; set "
            f"trainer.microbatch_size to a divisor of {per_rank}"
        )
    if trainer.sync_batchnorm and trainer.world_size_invariant:
        raise ReprotrainError(
            "trainer.sync_batchnorm and trainer.world_size_invariant exclude each other: "
            "invariant runs normalise over each micro-batch; drop one of them"
        )
    if micro and per_rank % micro:
        raise ReprotrainError(
            f"trainer.microbatch_size={micro} does not divide the per-rank batch "
            f"({per_rank} = trainer.batch_size / world size); pick a divisor of it"
        )


# Where or how to look, not what to compute: out of config_sha256 (loggers never change bits;
# the device's identity is run.json's environment).
NON_IDENTITY_KEYS = _keys(
    "resume dataset.root trainer.progress trainer.stop_after_epoch trainer.num_workers "
    "trainer.device trainer.allow_device_change trainer.profile_steps "
    "trainer.stop_at_global_step trainer.allow_world_size_change "
    "trainer.allow_unrestored_state trainer.verify_resume include_untracked tags"
)
NON_IDENTITY_PREFIXES = ("logger.",)


def is_identity(key: str) -> bool:
    """Whether a dotted key changes what is computed (and so the config's identity)."""
    return key not in NON_IDENTITY_KEYS and not key.startswith(NON_IDENTITY_PREFIXES)


def config_sha256(container: dict, extended_from: list[dict] | None = None) -> str:
    """sha256 of the resolved config's identity keys; ``extended_from``: a resume's
    ``trainer.epochs`` extensions (a stretched schedule is another computation)."""
    ident = {k: v for k, v in flatten(container).items() if is_identity(k)}
    if extended_from:
        ident["extended_from"] = extended_from
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
