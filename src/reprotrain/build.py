"""Building a run's parts from its config: data and pipeline, model, optimizer, schedule,
scaler, task and step. Used by the trainer and by ``make eval`` alike.

Closes: initialisation drift from build order. The model, optimizer, schedule and step are
built in one fixed order under the ``init`` stream (the caller seeds it first), so the same
config gives the same initial weights; the order is part of the bits.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from reprotrain.callbacks import Callbacks
from reprotrain.components import (
    build,
    build_callbacks,
    build_naming_key,
    build_scheduler,
    build_step,
    build_task,
    qualname,
)
from reprotrain.config import ModelSettings, PipelineSettings, StepSettings, check_num_classes
from reprotrain.data.datasets import build_dataset
from reprotrain.data.pipeline import build_pipeline
from reprotrain.engine import StepRunner, TrainerState
from reprotrain.optim import kind as schedule_kind
from reprotrain.optim import param_groups, unwrapped
from reprotrain.reduction import Reduction
from reprotrain.repro import precision as float_math
from reprotrain.repro.seeding import Seeds


def build_data(
    dataset_cfg: DictConfig,
    num_classes: int | None,
    settings: PipelineSettings,
    seeds: Seeds,
    device: torch.device,
    *,
    rank: int = 0,
    world_size: int = 1,
    channels_last: bool = False,
    microbatch_collate: int = 0,
):
    """The dataset ``_target_`` and the pipeline that serves it (device or DataLoader);
    ``num_classes`` is the model's declared class count (None: not declared), checked
    against the dataset's. ``microbatch_collate``: samples per collate call (the
    reduction's ``microbatch_collate``; 0: a rank's share of each step at once)."""
    dataset = build_dataset(dataset_cfg)
    splits = dataset.splits()
    check_num_classes(num_classes, splits.num_classes)
    pipeline = build_pipeline(
        settings.pipeline, splits, dataset, settings.num_workers,
        batch_size=settings.batch_size, eval_batch_size=settings.eval_batch_size,
        device=device, seeds=seeds, channels_last=channels_last,
        limit_train_steps=settings.limit_train_steps,
        limit_eval_batches=settings.limit_eval_batches,
        overfit_batches=settings.overfit_batches,
        rank=rank, world_size=world_size, microbatch_collate=microbatch_collate,
    )  # fmt: skip
    return dataset, pipeline


def build_model(model_cfg: DictConfig, device: torch.device, channels_last: bool) -> nn.Module:
    """The model ``_target_`` on ``device`` (NHWC if asked); a refused key is named."""
    model = build_naming_key("model", model_cfg, lambda node: build("model", node)).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def build_training(
    model_cfg: DictConfig,
    optimizer_cfg: DictConfig,
    scheduler_cfg: DictConfig,
    task_cfg: DictConfig,
    loss_cfg: DictConfig | None,
    step_cfg: DictConfig,
    settings: ModelSettings,
    step_settings: StepSettings,
    *,
    total_steps: int,
    device: torch.device,
    reduction: Reduction,
    train_seed: int,
) -> StepRunner:
    """The trainer's state (model, optimizer, schedule, scaler, loop, rng, task, step) and
    the runner that drives it: the reduction's forward module, the task, the user's step.
    Built in this order under the ``init`` stream (the order is part of the bits)."""
    model = build_model(model_cfg, device, settings.channels_last)
    optimizer = build("optimizer", optimizer_cfg,
                      params=param_groups(model, settings.no_decay_norm_bias))  # fmt: skip
    scheduler = build_scheduler(scheduler_cfg, optimizer, total_steps=total_steps)
    scaler = torch.amp.GradScaler(
        device.type, init_scale=settings.amp_init_scale,
        enabled=float_math.uses_grad_scaler(step_settings.precision),
    )  # fmt: skip
    model, forward = reduction.prepare(model)
    if settings.compile:
        forward = torch.compile(forward, mode=settings.compile_mode)
    task = build_task(task_cfg, loss_cfg)
    user_step = build_step(step_cfg, model)
    state = TrainerState(model, optimizer, scheduler, scaler, device, task=task,
                         rng_state=reduction.checkpoints_rank_state, rank=reduction.rank,
                         user_step=user_step)  # fmt: skip
    return StepRunner(state, task, forward=forward, reduction=reduction, settings=step_settings,
                      train_seed=train_seed, user_step=user_step)  # fmt: skip


def schedule_for(scheduler_cfg: DictConfig, optimizer: Any, steps_per_epoch: int) -> Any:
    """epochs -> the ``scheduler`` group's schedule over that many epochs on ``optimizer``:
    a resume that extends ``trainer.epochs`` replays the steps before it under the schedule
    they ran with (``Trainer.replay_state``)."""
    return lambda epochs: build_scheduler(
        scheduler_cfg, optimizer, total_steps=steps_per_epoch * epochs
    )


def callbacks_for(node: Any, device: torch.device, scheduler: Any = None) -> Callbacks:
    """The ``callbacks`` group's callbacks by name (none when it is null), built after the
    model under whatever the caller seeded: a callback's construction draws no stream.
    ``scheduler``: the run's, which decides whether a callback may set the lr."""
    per_step = scheduler is not None and schedule_kind(scheduler) == "step"
    return Callbacks(build_callbacks(node), device,
                     lr_set_by=qualname(scheduler) if per_step else None)  # fmt: skip


def components_record(settings: ModelSettings, runner: StepRunner, dataset: Any) -> dict:
    """The classes that actually ran, and the optimizer's parameter groups."""
    state = runner.state
    names = {k: qualname(getattr(state, k)) for k in ("model", "optimizer")}
    names["scheduler"] = qualname(unwrapped(state.scheduler))  # ReduceLROnPlateau, not its driver
    return names | {
        "task": qualname(runner.task),
        "step": qualname(runner.user_step),
        # The weights validation and test evaluate: the model's, or the step's (EMA).
        "evaluated_with": getattr(runner.user_step, "evaluated_with", "model weights"),
        "reduction": runner.reduction.name,
        "lr": state.optimizer.defaults.get("lr"),  # the optimizer's own, as configured
        "loss": qualname(getattr(runner.task, "loss_fn", None)),
        "dataset": qualname(dataset),
        "param_groups": [
            {"params": sum(p.numel() for p in g["params"]), "weight_decay": g["weight_decay"]}
            for g in state.optimizer.param_groups
        ],
        "compile": settings.compile and settings.compile_mode,
        "channels_last": settings.channels_last,
        "microbatch_size": runner.settings.microbatch_size,
        "callbacks": {
            name: qualname(cb) for name, cb in getattr(state.callbacks, "callbacks", {}).items()
        },
    }
