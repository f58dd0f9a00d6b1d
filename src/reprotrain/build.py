"""The build room: every ``_target_`` of the config built here, in one fixed order (data,
model, optimizer, schedule, scaler, task, step, callbacks, saver).

Closes: initialisation drift from build order: the model, optimizer, schedule and step are
built under the ``init`` stream, the loop's state under ``train``; the order is in the bits.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from reprotrain.callbacks import Callbacks
from reprotrain.components import build as instantiate
from reprotrain.components import (
    build_callbacks,
    build_dataset,
    build_given,
    build_naming_key,
    build_scheduler,
    build_step,
    build_task,
    qualname,
    takes,
)
from reprotrain.config import ModelSettings, PipelineSettings, check_num_classes
from reprotrain.data.pipeline import PipelineSpec, build_pipeline
from reprotrain.data.purity import check_samples
from reprotrain.data.sampler import refuse_elsewhere
from reprotrain.optim import param_groups, peak_lr, schedule_kind, unwrapped
from reprotrain.repro import checkpoint
from reprotrain.repro import precision as float_math
from reprotrain.repro.seeding import Seeds, seed_globals
from reprotrain.resume.audit import ResumeAudit
from reprotrain.run import record as rec
from reprotrain.start import Run
from reprotrain.step.runner import StepRunner, TrainerState


@dataclass(frozen=True)
class Targets:
    """The config's ``_target_`` groups: the build room's input, instantiated nowhere else."""

    dataset: DictConfig
    model: DictConfig
    optimizer: DictConfig
    scheduler: DictConfig
    task: DictConfig
    loss: DictConfig | None
    step: DictConfig
    callbacks: DictConfig | None
    sampler: DictConfig | None  # conf/sampler/: each epoch's order (None: the shuffle)

    @classmethod
    def of(cls, cfg: DictConfig) -> Targets:
        return cls(**{f.name: cfg[f.name] for f in fields(cls)})


@dataclass
class Parts:
    """What the loop drives; ``schedule``: the lr schedule over any number of epochs."""

    pipeline: Any
    runner: StepRunner
    saver: checkpoint.Saver
    schedule: Schedule


def build(targets: Targets, run: Run) -> Parts:
    """Data, then model to callbacks under ``init``, then the saver under ``train``."""
    settings, record, dist = run.settings, run.record, run.dist
    collate = run.reduction.microbatch_collate(settings.pipeline.batch_size // run.microbatches)
    dataset, pipeline = build_data(
        targets.dataset, targets.model.get("num_classes"), settings.pipeline, run.seeds,
        run.device, targets.sampler, rank=dist.rank, world_size=dist.world_size,
        microbatch_collate=collate, channels_last=settings.model.channels_last,
    )  # fmt: skip
    run.kind.record_data(record, dataset.fingerprint())
    check_samples(pipeline, run.level, record)
    seed_globals(run.seeds.init)
    runner, schedule = build_training(targets, run, pipeline.steps_per_epoch)
    state = runner.state
    state.callbacks = callbacks_for(targets.callbacks, run.device, state.scheduler)
    record.update(components=components_record(settings.model, runner, pipeline))
    state.audit = ResumeAudit(
        runner.task, dataset, state.model, run.device, step=state.user_step, dist=dist,
        trainer_state=state, pipeline=pipeline,
    )  # fmt: skip
    seed_globals(run.seeds.train)
    seeds, sha = run.seeds.as_dict(), record["config_sha256"]
    meta = checkpoint.Meta(config=run.container, config_sha256=sha, seeds=seeds, env=run.env)
    where, keep = run.run_dir / rec.CHECKPOINTS, settings.run.keep_checkpoints
    saver = checkpoint.Saver(where, state, meta, keep, gather=run.reduction.checkpoint)
    float_math.check_unchanged()  # no constructor set torch's fp32_precision settings
    return Parts(pipeline, runner, saver, schedule)


def build_data(
    node: DictConfig, num_classes: int | None, settings: PipelineSettings, seeds: Seeds,
    device: torch.device, sampler: DictConfig | None = None, **layout: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """The dataset and the pipeline that serves it; ``num_classes``: the model's (None: not
    declared), checked against the dataset's; ``sampler``: the group's node (data/sampler.py).
    ``layout``: the pipeline's ``rank``, ``world_size``, ``channels_last`` and
    ``microbatch_collate`` (defaults: one process)."""
    dataset = build_dataset(node)
    splits = dataset.splits()
    refuse_elsewhere(**{f"dataset {qualname(dataset)}": dataset, "its train split": splits.train})
    if sampler is not None:  # the training split handed as `data_source` when it takes one
        split = {"data_source": splits.train} if takes(sampler, "sampler", "data_source") else {}
        layout["sampler"] = build_given("sampler", sampler, **split)
    check_num_classes(num_classes, splits.num_classes)
    limits = ("batch_size", "eval_batch_size", "limit_train_steps", "limit_eval_batches",
              "overfit_batches")  # fmt: skip
    kw = {name: getattr(settings, name) for name in limits}
    pipeline = build_pipeline(settings.pipeline, splits, dataset, settings.num_workers,
                              PipelineSpec(device=device, seeds=seeds, **kw, **layout))  # fmt: skip
    return dataset, pipeline


def build_model(model_cfg: DictConfig, device: torch.device, channels_last: bool) -> nn.Module:
    """The model ``_target_`` on ``device`` (NHWC if asked); a refused key is named."""
    model = build_naming_key("model", model_cfg, lambda node: instantiate("model", node)).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def build_training(targets: Targets, run: Run, steps_per_epoch: int) -> tuple[StepRunner, Any]:
    """The trainer's state and its runner, in this order under ``init``; the schedule."""
    opts, reduction, device = run.settings.model, run.reduction, run.device
    model = build_model(targets.model, device, opts.channels_last)
    params = param_groups(model, opts.no_decay_norm_bias)
    optimizer = instantiate("optimizer", targets.optimizer, params=params)
    schedule = Schedule(targets.scheduler, optimizer, steps_per_epoch)
    scheduler = schedule.over(run.settings.loop.epochs)
    scales = float_math.uses_grad_scaler(run.settings.step.precision)
    scaler = torch.amp.GradScaler(device.type, init_scale=opts.amp_init_scale, enabled=scales)
    model, forward = reduction.prepare(model)
    if opts.compile:
        forward = torch.compile(forward, mode=opts.compile_mode)
    task = build_task(targets.task, targets.loss)
    user_step = build_step(targets.step, model)
    state = TrainerState(
        model, optimizer, scheduler, scaler, device,
        rng_state=reduction.checkpoints_rank_state, rank=reduction.rank,
    )  # fmt: skip
    runner = StepRunner(
        state, task, forward=forward, reduction=reduction, settings=run.settings.step,
        train_seed=run.seeds.train, user_step=user_step,
    )  # fmt: skip
    return runner, schedule


@dataclass(frozen=True)
class Schedule:
    """The one place the lr schedule is decided: ``over(epochs)``, the ``scheduler`` over that
    many epochs; ``resumed`` the same at a loaded state's position (a resume that extends the
    run replays its past under the old length: ``Trainer.replay_state``)."""

    node: DictConfig
    optimizer: Any
    steps_per_epoch: int

    def over(self, epochs: int) -> Any:
        return build_scheduler(self.node, self.optimizer, self.steps_per_epoch * epochs)

    def resumed(self, epochs: int, current: Any) -> Any:
        """``over(epochs)`` carrying ``current``'s state and the optimizer's lrs (building a
        scheduler resets the lr)."""
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        past = self.over(epochs)
        past.load_state_dict(current.state_dict())
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        return past


def callbacks_for(node: Any, device: torch.device, scheduler: Any = None) -> Callbacks:
    """The ``callbacks`` group; ``scheduler`` decides whether a callback may set the lr."""
    per_step = scheduler is not None and schedule_kind(scheduler) == "step"
    lr_set_by = qualname(scheduler) if per_step else None
    return Callbacks(build_callbacks(node), device, lr_set_by=lr_set_by)


def components_record(settings: ModelSettings, runner: StepRunner, pipeline: Any) -> dict:
    """The classes that actually ran (the pipeline's dataset and sampler too), and the
    optimizer's parameter groups."""
    state = runner.state
    names = {k: qualname(getattr(state, k)) for k in ("model", "optimizer")}
    names["scheduler"] = qualname(unwrapped(state.scheduler))  # ReduceLROnPlateau, not its driver
    return names | {
        "task": qualname(runner.task),
        "step": qualname(runner.user_step),
        # The weights validation and test evaluate: the model's, or the step's (EMA).
        "evaluated_with": getattr(runner.user_step, "evaluated_with", "model weights"),
        "reduction": runner.reduction.name,
        "lr": peak_lr(state.scheduler, state.optimizer),  # the schedule's (OneCycleLR's max_lr)
        "loss": qualname(getattr(runner.task, "loss_fn", None)),
        "dataset": qualname(pipeline.dataset),
        "sampler": qualname(pipeline.sampler) if pipeline.sampler is not None else None,
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
