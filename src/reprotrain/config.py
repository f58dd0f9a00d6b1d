"""Structured config schema, registered in Hydra's ConfigStore.

Each YAML under ``conf/<group>/`` names one of these dataclasses as its schema, so a
misspelt key (``trainer.epoch``), a wrong type (``trainer.epochs=abc``) or an unknown group
option (``model=resnet999``) fails while Hydra composes the config, before any run
directory exists. ``validate`` adds the range checks a type cannot express.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from reprotrain.errors import ReprotrainError


@dataclass
class DatasetConfig:
    name: str = MISSING  # cifar10 | synthetic
    root: str = "data"  # relative paths resolve against the repo root, not the run dir
    download: bool = True
    url: str = ""
    md5: str = ""
    num_train: int = 0  # synthetic only
    num_test: int = 0  # synthetic only
    data_seed: int = 0  # synthetic only: fixed, independent of the run seed
    noise: float = 0.0  # synthetic only: pixel noise (std, 0..255 scale)
    mean: list[float] = field(default_factory=lambda: [0.4914, 0.4822, 0.4465])
    std: list[float] = field(default_factory=lambda: [0.2470, 0.2435, 0.2616])
    augment: bool = True  # random crop 32 (pad 4) + horizontal flip, counter-based


@dataclass
class ModelConfig:
    name: str = MISSING  # resnet18 | resnet_tiny
    widths: list[int] = field(default_factory=lambda: [64, 128, 256, 512])
    blocks: list[int] = field(default_factory=lambda: [2, 2, 2, 2])
    num_classes: int = 10


@dataclass
class OptimizerConfig:
    name: str = MISSING  # sgd | adamw
    lr: float = 0.1
    weight_decay: float = 5e-4
    momentum: float = 0.9  # sgd
    nesterov: bool = True  # sgd
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw


@dataclass
class SchedulerConfig:
    name: str = MISSING  # onecycle | cosine | constant
    warmup_fraction: float = 0.0  # onecycle: pct_start; cosine: linear warmup share
    final_lr_fraction: float = 0.0  # cosine: eta_min = lr * this


@dataclass
class SeedConfig:
    base: int | None = 42
    from_entropy: bool = False  # draw base from os.urandom and record it (seed=entropy)
    # Per-stream overrides; null means "derived from base".
    init: int | None = None
    data: int | None = None
    augment: int | None = None
    train: int | None = None


@dataclass
class ReproConfig:
    level: str = "strict"  # strict | warn | fast
    num_threads: int = 2  # CPU intra-op threads: changes reduction order, so it is recorded
    fill_uninitialized_memory: bool = True  # see README: deterministic NaN fill of torch.empty
    require_locked_env: bool = False  # drift between .venv and the lock becomes fatal


@dataclass
class TrainerConfig:
    device: str = "auto"  # auto | cpu | cuda
    epochs: int = 30
    batch_size: int = 512
    eval_batch_size: int = 1024
    eval_every: int = 1  # epochs; the last epoch is always evaluated
    checkpoint_every_steps: int = 0  # 0: only at epoch ends
    keep_checkpoints: int = 3
    pipeline: str = "device"  # device: dataset resident on device | loader: DataLoader path
    num_workers: int = 0  # loader pipeline only
    amp: bool = False  # bf16 autocast on CUDA (and CPU); fp16 uses the GradScaler
    amp_dtype: str = "bf16"  # bf16 | fp16
    amp_init_scale: float = 65536.0  # fp16 only: GradScaler's starting loss scale
    label_smoothing: float = 0.0
    progress: bool = True  # tqdm bar; silenced automatically when stderr is not a TTY
    # Stop (status completed, partial) after this epoch without changing the schedule, so
    # the first epochs of a long run can be spot-checked bit for bit. 0: run all epochs.
    stop_after_epoch: int = 0


@dataclass
class TrainConfig:
    dataset: DatasetConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    seed: SeedConfig = MISSING
    repro: ReproConfig = MISSING
    trainer: TrainerConfig = MISSING
    name: str = "run"  # experiment name, part of the run directory name
    resume: str | None = None  # null | auto | path/to/checkpoint.pt


def register_configs() -> None:
    """Register the schema for train.yaml and for each config group."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, node in [
        ("dataset", DatasetConfig),
        ("model", ModelConfig),
        ("optimizer", OptimizerConfig),
        ("scheduler", SchedulerConfig),
        ("seed", SeedConfig),
        ("repro", ReproConfig),
        ("trainer", TrainerConfig),
    ]:
        cs.store(group=group, name=f"{group}_schema", node=node)


CHOICES = {
    "dataset.name": ("cifar10", "synthetic"),
    "model.name": ("resnet18", "resnet_tiny"),
    "optimizer.name": ("sgd", "adamw"),
    "scheduler.name": ("onecycle", "cosine", "constant"),
    "repro.level": ("strict", "warn", "fast"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.pipeline": ("device", "loader"),
    "trainer.amp_dtype": ("bf16", "fp16"),
}


def validate(cfg: DictConfig | Any) -> None:
    """Range checks a dataclass type cannot express; raises one-line ``ReprotrainError``."""

    def get(key: str) -> Any:
        node: Any = cfg
        for part in key.split("."):
            node = node[part]
        return node

    for key, allowed in CHOICES.items():
        if get(key) not in allowed:
            raise ReprotrainError(f"{key}={get(key)!r} is not one of {', '.join(allowed)}")
    positive = [
        "trainer.epochs",
        "trainer.batch_size",
        "trainer.eval_batch_size",
        "trainer.eval_every",
        "trainer.keep_checkpoints",
        "repro.num_threads",
        "optimizer.lr",
        "model.num_classes",
        "trainer.amp_init_scale",
    ]
    for key in positive:
        if not get(key) > 0:
            raise ReprotrainError(f"{key}={get(key)} must be > 0")
    non_negative = [
        "trainer.checkpoint_every_steps",
        "trainer.num_workers",
        "trainer.label_smoothing",
        "optimizer.weight_decay",
        "dataset.noise",
    ]
    for key in non_negative:
        if get(key) < 0:
            raise ReprotrainError(f"{key}={get(key)} must be >= 0")
    if not 0 <= cfg.trainer.label_smoothing < 1:
        raise ReprotrainError("trainer.label_smoothing must be in [0, 1)")
    if len(cfg.model.widths) != len(cfg.model.blocks) or not cfg.model.widths:
        raise ReprotrainError("model.widths and model.blocks must be non-empty and equally long")
    if cfg.dataset.name == "synthetic" and min(cfg.dataset.num_train, cfg.dataset.num_test) <= 0:
        raise ReprotrainError("dataset.num_train and dataset.num_test must be > 0 for synthetic")
    if cfg.dataset.name == "synthetic" and cfg.dataset.num_train < cfg.trainer.batch_size:
        raise ReprotrainError(
            f"trainer.batch_size={cfg.trainer.batch_size} is larger than the training set "
            f"({cfg.dataset.num_train}); lower it or raise dataset.num_train"
        )
    if cfg.seed.base is None and not cfg.seed.from_entropy:
        raise ReprotrainError("seed.base is null; set seed.base=<int> or use seed=entropy")
    if cfg.trainer.pipeline == "device" and cfg.trainer.num_workers:
        raise ReprotrainError("trainer.num_workers needs trainer.pipeline=loader")


# Keys that say where or how to look, not what to compute: left out of config_sha256 so a
# resumed or relocated run keeps its identity (data identity is the data fingerprint).
NON_IDENTITY_KEYS = ("resume", "dataset.root", "trainer.progress", "trainer.stop_after_epoch")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"trainer.epochs": 30, ...}: dotted keys, as in overrides and error messages."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_sha256(container: dict) -> str:
    """sha256 of the resolved config (sorted dotted keys), identity keys only."""
    ident = {k: v for k, v in flatten(container).items() if k not in NON_IDENTITY_KEYS}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
