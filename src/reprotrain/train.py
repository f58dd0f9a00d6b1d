"""Reference trainer: compose -> controls -> build -> loop -> record. Reads top to bottom.

    python -m reprotrain.train experiment=smoke            # or: make train ARGS="..."
    python -m reprotrain.train --multirun seed.base=0,1,2  # or: make sweep SEEDS=0,1,2

Exit codes: 0 completed; 2 user error (one line on stderr, run marked failed; also a
non-finite loss under trainer.on_nonfinite=stop); 75 interrupted by SIGTERM, SIGINT or
SIGUSR2 after writing a checkpoint (resume with ``resume=auto`` or ``make resume``);
130 aborted by a second SIGINT (previous checkpoints still valid).
"""

from __future__ import annotations

import sys

from reprotrain.repro import hashseed

if __name__ == "__main__":
    # PYTHONHASHSEED is only read at interpreter start: re-exec now, before importing torch,
    # if it is not fixed. Then check the overrides while it is still cheap: a typo fails in
    # a second, in one line.
    from reprotrain import launchers

    launchers.die_with_parent()  # torchrun workers die with their agent, never orphaned
    hashseed.ensure()
    from reprotrain import preflight

    preflight.cli_check()

import contextlib
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from reprotrain import fault_injection, launchers, preflight
from reprotrain.components import (
    build,
    build_naming_key,
    build_scheduler,
    build_step,
    build_task,
    qualname,
)
from reprotrain.config import (
    GuardSettings,
    LoopSettings,
    ModelSettings,
    PipelineSettings,
    ReproConfig,
    StepSettings,
    TrainerSettings,
    check_layout,
    config_sha256,
    microbatches_per_step,
)
from reprotrain.data import worker_death
from reprotrain.data.datasets import build_dataset
from reprotrain.data.file_hashes import file_sha256
from reprotrain.data.pipeline import build_pipeline
from reprotrain.distributed import Dist, init_from_env
from reprotrain.engine import (
    LoopState,
    StepRunner,
    TrainerState,
    epoch_metrics,
    evaluate,
    run_epoch,
)
from reprotrain.errors import ReprotrainError, ResumeError
from reprotrain.loggers import build_loggers, resumed_history
from reprotrain.optim import param_groups
from reprotrain.paths import REPO_ROOT
from reprotrain.profiling import StepProfiler
from reprotrain.quoting import resume_hint
from reprotrain.reduction import Reduction, for_run
from reprotrain.repro import (
    checkpoint,
    determinism,
    environment,
    gitinfo,
    requirements_lock,
    secrets,
)
from reprotrain.repro import device as devices
from reprotrain.repro import record as rec
from reprotrain.repro import run_dir as run_dirs
from reprotrain.repro.fingerprint import losses_sha256, state_sha256
from reprotrain.repro.resume_audit import ResumeAudit
from reprotrain.repro.resume_guard import (
    AlreadyCompleted,
    check_unrestored,
    find_resume_point,
    resume_entry,
)
from reprotrain.repro.run_mutex import RunMutex
from reprotrain.repro.seeding import Seeds, resolve_seeds, seed_globals
from reprotrain.tools.runs.report import write_report

log = logging.getLogger("reprotrain")
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: "try again later", what a requeue wrapper looks for
EXIT_ABORTED = 130
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)  # SIGUSR2: SLURM/submitit


def train(cfg: DictConfig, run_dir: Path, dist: Dist) -> float | None:
    # --- compose: the resolved config is the run's identity (oc.env values as digests) ------
    # The batch layout against the world size this job has: compose time saw the launcher's
    # WORLD_SIZE, which a submitit job exports only once its tasks start.
    check_layout(cfg.trainer, dist.world_size)
    container, env_values = secrets.redact(cfg)
    point = find_resume_point(cfg.resume, run_dir, container)  # None: fresh start
    log.info("run dir: %s", run_dir)  # after the refusals: a refused resume writes nothing
    fresh = point is None or point.forked
    record = rec.RunRecord(run_dir) if fresh else rec.RunRecord.load(run_dir)
    record.update(status="running", config_sha256=config_sha256(container))
    record.update(tags=list(container.get("tags") or []))  # labels, not identity
    record.update(env_interpolations=env_values)
    rec.atomic_write_text(run_dir / rec.RESOLVED_CONFIG, OmegaConf.to_yaml(container))
    stop = StopFlag()

    # --- controls: determinism level, seeds, device, environment ---------------------------
    settings = TrainerSettings.from_config(cfg.trainer)  # each part goes to what reads it
    flags = determinism.apply(
        cfg.repro.level, cfg.repro.num_threads, cfg.repro.fill_uninitialized_memory
    )
    seeds = Seeds(**point.state["seeds"]) if point else resolve_seeds(cfg.seed)
    # Resume reuses the device the run started on, not a fresh `auto` (None: a new run).
    recorded = devices.recorded_device(record.data) if not fresh else None
    device = devices.resolve_for_resume(
        recorded, settings.run.device, settings.run.allow_device_change,
        local_rank=dist.local_rank if dist.enabled else None,
    )  # fmt: skip
    env = environment.capture(device)
    reduction = for_run(settings.reduction, dist)
    check_world_size(reduction, point, settings.reduction.allow_world_size_change)
    if fresh:
        start_record(
            record, run_dir, point, device, seeds=seeds, flags=flags, env=env, repro=cfg.repro,
            name=OmegaConf.to_container(cfg, resolve=False)["name"],  # an oc.env stays text
            include_untracked=list(cfg.include_untracked),
        )  # fmt: skip
    record.update(**distributed_record(dist, device))
    k = microbatches_per_step(settings.pipeline.batch_size, settings.step.microbatch_size)
    record.update(**reduction.record(k))
    log.info(
        "experiment %s | repro=%s | seeds %s | device %s | world size %d",
        record["experiment_id"], flags["level"], seeds.as_dict(), device, dist.world_size,
    )  # fmt: skip

    # --- build: data, then model (from the `init` stream), optimizer, schedule, task -------
    dataset, pipeline = build_data(
        cfg.dataset, cfg.model, settings.pipeline, seeds, device, dist,
        channels_last=settings.model.channels_last,
    )  # fmt: skip
    record.update(data_fingerprint=dataset.fingerprint())
    seed_globals(seeds.init)
    runner = build_training(
        cfg.model, cfg.optimizer, cfg.scheduler, cfg.task, cfg.loss, cfg.step,
        settings.model, settings.step, total_steps=pipeline.steps_per_epoch * settings.loop.epochs,
        device=device, reduction=reduction, train_seed=seeds.train,
    )  # fmt: skip
    state = runner.state
    record.update(components=components_record(settings.model, runner, dataset))
    state.audit = ResumeAudit(runner.task, dataset, state.model, device, state.step, dist)

    # --- resume or start: seed the `train` stream (a resume then restores the state) -------
    seed_globals(seeds.train)  # what an Exact resume re-derives (its checkpoint has no rng)
    if point is not None:
        resume_from(point, state, record, env, device, run_dir, container)
    else:
        record.update(initial_weights_sha256=state_sha256(state.model.state_dict()))
    meta = {"config": container, "config_sha256": record["config_sha256"]}
    meta |= {"seeds": seeds.as_dict(), "env": env}
    saver = checkpoint.Saver(
        run_dir / rec.CHECKPOINTS, state, meta, settings.run.keep_checkpoints,
        gather=reduction.checkpoint,
    )  # fmt: skip
    out = RunOutputs(saver, record, stop, run_dir)

    # --- loop: epochs of counter-based batches; checkpoint on cadence and on signals -------
    alerts, feed = run_loop(runner, pipeline, out, dist, settings.loop, settings.guard, cfg.logger)

    # --- record: test once at the end; the final state a later verify/reproduce compares ---
    return finish(runner, pipeline, out, alerts, feed, settings.loop)


# ------------------------------------------------------------------ the steps train() calls


@dataclass
class RunOutputs:
    """Where a run writes: its checkpoints, its record, its directory; and its stop flag."""

    saver: checkpoint.Saver
    record: rec.RunRecord
    stop: StopFlag
    run_dir: Path


def run_loop(
    runner: StepRunner,
    pipeline,
    out: RunOutputs,
    dist: Dist,
    settings: LoopSettings,
    guard: GuardSettings,
    logger_cfg: DictConfig,
) -> tuple[list[str], StepFeed]:
    """Epochs of counter-based batches from the loop state's position; checkpoints on
    cadence, at epoch ends and on signals. Returns the alerts seen and the logger feed."""
    state, reduction = runner.state.loop, runner.reduction
    alerts: list[str] = list(out.record.data.get("nondeterministic_ops", []))
    every, epochs = settings.checkpoint_every_steps, settings.epochs
    stop_at = settings.stop_at_global_step
    bar = EpochBar(settings.progress)
    history = resumed_history(state.fingerprints, state.metrics, state.progress.losses(),
                              state.progress.step_lrs, state.global_step)  # fmt: skip
    # MLflow attaches report.md and curves.png at the end, drawn by make report's writer.
    sinks = build_loggers(logger_cfg, out.run_dir, out.record.data, state.global_step, history,
                          report=write_report)  # fmt: skip
    feed = StepFeed(sinks, state)
    profiler = StepProfiler(out.run_dir / "profile", settings.profile_steps, state.device).start() \
        if settings.profile_steps and dist.is_main else None  # fmt: skip

    def after_step(next_step: int) -> None:
        bar.step(state.progress, state.global_step)
        if reduction.step_values_are_global:  # else global only at epoch end
            feed.every(logger_cfg.log_every_steps)
        if profiler is not None:
            profiler.step()
        fault_injection.hook("step", state.global_step)
        if dist.all_reduce_any(out.stop.signal_name is not None):  # every rank, same step
            feed.close("interrupted")
            interrupted(out, state)
        if stop_at and state.global_step == stop_at and next_step < pipeline.steps_per_epoch:
            out.stop.signal_name = f"trainer.stop_at_global_step={stop_at}"
            interrupted(out, state)
        if every and state.global_step % every == 0 and next_step < pipeline.steps_per_epoch:
            out.saver.save()

    with determinism.nondeterminism_alerts(alerts):
        while state.epoch <= epochs and state.early_stopped is None:
            bar.start(state.epoch, pipeline.steps_per_epoch, state.step)
            seen_before = state.progress.seen
            seconds = run_epoch(
                runner, pipeline.epoch(state.epoch, state.step),
                check_every=guard.nonfinite_check_every,
                on_nonfinite=guard.on_nonfinite, after_step=after_step,
                any_rank=dist.all_reduce_any,
                saving=lambda gs: bool(every and gs % every == 0) or gs == stop_at,  # all ranks
            )  # fmt: skip
            reduction.end_epoch(state.progress)  # the epoch's losses and sums, global
            feed.flush()
            trained = state.progress.seen - reduction.global_count(seen_before)
            row = end_epoch(runner, pipeline, out, settings, seconds, trained)
            feed.epoch(row)
            out.record.update(nondeterministic_ops=alerts, nonfinite_events=state.nonfinite_events)
            asked = stop_at and state.global_step == stop_at
            stopping = out.stop.signal_name is not None or asked
            if dist.all_reduce_any(stopping) and state.epoch <= epochs:
                out.stop.signal_name = (
                    out.stop.signal_name or f"trainer.stop_at_global_step={stop_at}"
                )
                interrupted(out, state)
            if settings.stop_after_epoch and state.epoch > settings.stop_after_epoch:
                break  # spot check: the schedule still spans trainer.epochs
    bar.close()
    if profiler is not None:
        log.info("top ops (%s):\n%s", profiler.table_path, profiler.stop())
    return alerts, feed


class EpochBar:
    """The epoch's progress bar with the running loss, on a terminal only (elsewhere the
    epoch lines of the log say the same). The loss shown is the mean of the last ``every``
    steps: one host read every ``every`` steps, never one per step."""

    def __init__(self, enabled: bool, every: int = 10) -> None:
        self.bar = tqdm(disable=not (enabled and sys.stderr.isatty()), leave=False)
        self.every = every

    def start(self, epoch: int, total: int, done: int) -> None:
        self.bar.reset(total=total)
        self.bar.update(done)
        self.bar.set_description(f"epoch {epoch}")

    def step(self, progress, global_step: int) -> None:
        self.bar.update(1)
        if not self.bar.disable and global_step % self.every == 0 and progress.step_losses:
            recent = torch.stack(progress.step_losses[-self.every :]).float().mean()
            self.bar.set_postfix(loss=f"{recent.item():.4g}")

    def close(self) -> None:
        self.bar.close()


class StopFlag:
    """SIGTERM/SIGINT/SIGUSR2 ask the loop to stop after this step; a second SIGINT aborts."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.requeue = launchers.submitit_requeue_handler()  # inside submitit, else None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then checkpointing", self.signal_name)


def finish(
    runner: StepRunner,
    pipeline,
    out: RunOutputs,
    alerts: list[str],
    feed: StepFeed,
    settings: LoopSettings,
) -> float | None:
    """Test once (last weights, then best), mark the run completed; the monitored best."""
    state = runner.state.loop
    final = final_metrics(runner, pipeline, out.run_dir)
    out.record.update(
        status="completed",
        finished_at=rec.now_iso(),
        final_weights_sha256=state.fingerprints[-1]["weights_sha256"],
        final_metrics=final,
        epochs_completed=len(state.metrics),
        partial=len(state.metrics) < settings.epochs,
        early_stopped=state.early_stopped,
        nondeterministic_ops=alerts,
        nonfinite_events=state.nonfinite_events,
        gpu_memory=environment.peak_memory(state.device),
    )
    feed.loggers.log_final(final)
    feed.close("completed")
    shown = "  ".join(f"{k}={v}" for k, v in final.items() if k.startswith("test_"))
    log.info("%s  %s=%s (best epoch %s)", shown, settings.monitor, state.best, state.best_epoch)
    log.info("completed: checkpoints in %s; report: make report RUN=%s", out.saver.dir, out.run_dir)
    return state.best


def start_record(
    record: rec.RunRecord,
    run_dir: Path,
    point,
    device: torch.device,
    *,
    name: str,
    seeds: Seeds,
    flags: dict,
    env: dict,
    repro: ReproConfig,
    include_untracked: list[str],
) -> None:
    """Identity of a fresh run: git, environment, lock; the run.json a reproduce replays."""
    drift = requirements_lock.env_drift(REPO_ROOT)
    if drift["status"] == "drift":
        summary = ", ".join(
            drift["missing"] + drift["extra"] + [d["name"] for d in drift["different"]]
        )
        if repro.require_locked_env:
            raise ReprotrainError(f".venv differs from the lock ({summary}); run `make install`")
        log.warning("environment drift against the lock: %s (run `make env-check`)", summary)
    git, diff = gitinfo.git_info(REPO_ROOT, include_untracked=include_untracked)
    if warning := gitinfo.archivability_warning(git):
        log.warning(warning)
    if diff:
        rec.atomic_write_text(run_dir / "git.diff", diff)
    record.update(
        run_dir=str(run_dir.resolve()),
        name=name,
        started_at=rec.now_iso(),
        command=["python", "-m", "reprotrain.train", *sys.argv[1:]],
        seeds=seeds.as_dict(),
        repro=flags,
        device=str(device),
        device_caveat=devices.bitwise_caveat(device),  # mps: kernels promise no determinism
        nondeterministic_ops=[],
        git=git,
        code_sha256=gitinfo.code_sha256(REPO_ROOT),  # compared at every resume
        environment=env,
        lock_sha256=requirements_lock.lock_sha256(REPO_ROOT),
        env_drift=drift,
        container=environment.container_image(),
        resumes=[],
    )
    record.update(experiment_id=experiment_id(record.data, device))
    if point is not None:  # resume=<another run's checkpoint>: a fork, with its parent named
        record.update(
            forked_from={
                "path": str(point.path),
                "sha256": file_sha256(point.path),
                "global_step": point.state["loop"]["global_step"],
            }
        )
    from torch.utils import collect_env

    rec.atomic_write_text(run_dir / "environment.txt", collect_env.get_pretty_env_info())


def experiment_id(record: dict, device: torch.device) -> str:
    """<config sha[:8]>-<commit>[+dirty]-<device>: follows the config that ran."""
    git = record["git"]
    dirty = "+dirty" if git.get("dirty") else ""
    return (
        f"{record['config_sha256'][:8]}-{git.get('short')}{dirty}-{environment.device_slug(device)}"
    )


def check_world_size(reduction: Reduction, point, allow_change: bool) -> None:
    """A resume under another world size: the reduction says whether it may (Exact: any
    world size dividing the micro-batches, which config checks)."""
    if point is None or point.forked:
        return
    saved = (point.state.get("env") or {}).get("world_size", 1)
    refused = reduction.resume_check(saved, allow_change)
    if refused is not None:
        raise ResumeError(refused)
    if saved != reduction.world_size:
        log.info("world size %d -> %d", saved, reduction.world_size)


def distributed_record(dist: Dist, device: torch.device) -> dict:
    """world size, backend and every rank's device and threads (a collective under DDP)."""
    me = {"rank": dist.rank, "device": str(device), "threads": torch.get_num_threads()}
    me["host"] = socket.gethostname()
    return {"world_size": dist.world_size, "backend": dist.backend,
            "ranks": dist.all_gather_objects(me)}  # fmt: skip


def build_data(
    dataset_cfg: DictConfig,
    model_cfg: DictConfig,
    settings: PipelineSettings,
    seeds: Seeds,
    device: torch.device,
    dist: Dist | None = None,
    *,
    channels_last: bool = False,
):
    """The dataset ``_target_`` and the pipeline that serves it (device or DataLoader);
    ``model_cfg`` only for its ``num_classes``, checked against the dataset's."""
    dataset = build_dataset(dataset_cfg)
    splits = dataset.splits()
    declared = model_cfg.get("num_classes")
    if declared is not None and declared != splits.num_classes:
        raise ReprotrainError(
            f"model.num_classes={declared} but the dataset has {splits.num_classes} classes; "
            f"set model.num_classes={splits.num_classes}"
        )
    pipeline = build_pipeline(
        settings.pipeline, splits, dataset, settings.num_workers,
        batch_size=settings.batch_size, eval_batch_size=settings.eval_batch_size,
        device=device, seeds=seeds, channels_last=channels_last,
        limit_train_steps=settings.limit_train_steps,
        limit_eval_batches=settings.limit_eval_batches,
        overfit_batches=settings.overfit_batches,
        rank=dist.rank if dist else 0, world_size=dist.world_size if dist else 1,
    )  # fmt: skip
    return dataset, pipeline


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
    model = build_naming_key("model", model_cfg, lambda node: build("model", node)).to(device)
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = build("optimizer", optimizer_cfg,
                      params=param_groups(model, settings.no_decay_norm_bias))  # fmt: skip
    scheduler = build_scheduler(scheduler_cfg, optimizer, total_steps=total_steps)
    scaler = torch.amp.GradScaler(
        device.type, init_scale=settings.amp_init_scale,
        enabled=(step_settings.amp, step_settings.amp_dtype) == (True, "fp16"),
    )  # fmt: skip
    model, forward = reduction.prepare(model)
    if settings.compile:
        forward = torch.compile(forward, mode=settings.compile_mode)
    task = build_task(task_cfg, loss_cfg)
    user_step = build_step(step_cfg, model)
    state = TrainerState(model, optimizer, scheduler, scaler, device, task=task,
                         rng_state=reduction.checkpoints_rank_state, rank=reduction.rank,
                         step=user_step)  # fmt: skip
    return StepRunner(state, task, forward=forward, reduction=reduction, settings=step_settings,
                      train_seed=train_seed, user_step=user_step)  # fmt: skip


def resume_from(
    point, trainer_state: TrainerState, record, env, device, run_dir: Path, container: dict
) -> None:
    trainer_state.load_state_dict(point.state)
    # Issue 25: what the checkpoint could not restore, named; refused under strict.
    unrestored = [] if point.forked else trainer_state.audit.unrestored()
    check_unrestored(point, unrestored, container, run_dir)
    state = trainer_state.loop
    # The files may have run ahead of the checkpoint (killed after writing them).
    rec.write_jsonl(run_dir / rec.METRICS, state.metrics)
    rec.write_jsonl(run_dir / rec.FINGERPRINTS, state.fingerprints)
    if point.forked:
        log.info("forked from %s", point.path)
        return
    code = (record.data.get("code_sha256"), gitinfo.code_sha256(REPO_ROOT))
    entry = resume_entry(point, env, device, container, unrestored, code=code)
    record.update(resumes=[*record.data.get("resumes", []), entry])
    record.update(experiment_id=experiment_id(record.data, device))  # the config that runs
    log.info("resumed from %s at epoch %d step %d", point.path.name, state.epoch, state.step)


def components_record(settings: ModelSettings, runner: StepRunner, dataset) -> dict:
    """The classes that actually ran, and the optimizer's parameter groups."""
    state = runner.state
    names = {k: qualname(getattr(state, k)) for k in ("model", "optimizer", "scheduler")}
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
    }


def interrupted(out: RunOutputs, state: LoopState) -> NoReturn:
    """Checkpoint, mark the run interrupted, hand a SIGUSR2 over to submitit's requeue."""
    out.saver.save()
    out.record.update(
        status="interrupted", interrupted_at=rec.now_iso(), interrupted_by=out.stop.signal_name
    )
    log.warning(
        "interrupted at epoch %d step %d; resume with `%s`",
        state.epoch, state.step, resume_hint(out.run_dir),
    )  # fmt: skip
    if out.stop.signal_name == "SIGUSR2" and out.stop.requeue is not None:
        release_lock()
        out.stop.requeue(signal.SIGUSR2, None)  # submitit requeues the job and exits
    sys.exit(EXIT_INTERRUPTED)


def end_epoch(
    runner: StepRunner, pipeline, out: RunOutputs, settings: LoopSettings, seconds: float, n: int
) -> dict:
    """Metrics row, fingerprint, checkpoint (best.pt when the monitored value improved)."""
    state = runner.state.loop
    row = {
        "epoch": state.epoch,
        "global_step": state.global_step,
        **epoch_metrics(runner.task, state.progress),
        "lr": epoch_lr(state.progress, runner.state.optimizer),
        "seconds": seconds,
        "images_per_s": n / seconds if seconds > 0 else None,
    }
    last = state.epoch == settings.epochs or state.epoch == settings.stop_after_epoch
    if pipeline.has_split("val") and (state.epoch % settings.eval_every == 0 or last):
        row.update(evaluate_split(runner, pipeline, "val"))
    state.metrics.append(row)
    cpu_state = {k: v.detach().to("cpu") for k, v in runner.state.model.state_dict().items()}
    losses = state.progress.losses()
    state.fingerprints.append(
        {
            "epoch": state.epoch,
            "global_step": state.global_step,
            "weights_sha256": state_sha256(cpu_state),
            "step_losses_sha256": losses_sha256(losses),
            "step_losses": losses,
            "step_lrs": state.progress.step_lrs,
        }
    )
    rec.write_jsonl(out.run_dir / rec.METRICS, state.metrics)
    rec.write_jsonl(out.run_dir / rec.FINGERPRINTS, state.fingerprints)
    shown = "  ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch" and v is not None)
    log.info("epoch %d/%d  %s", state.epoch, settings.epochs, shown)
    value, previous_best = row.get(settings.monitor), state.best
    improved = state.improved(value, settings.monitor_mode)
    state.count_stale(value, previous_best, settings)
    if state.early_stopped is not None:
        log.info("early stopping: %(monitor)s has not improved for %(patience)d evaluated "
                 "epochs; best %(best)s at epoch %(best_epoch)s", state.early_stopped)  # fmt: skip
    state.next_epoch()  # the epoch-end checkpoint resumes at the start of the next epoch
    out.saver.save(best=improved, model_state=cpu_state)
    fault_injection.hook("after-save", state.global_step)
    return row


def evaluate_split(runner: StepRunner, pipeline, split: str) -> dict:
    """``<split>_<name>`` of the task's metrics with the bare model's weights, or the ones
    the user's step swaps in (``evaluation_weights``: EMA)."""
    state, user_step = runner.state, runner.user_step
    weights = getattr(user_step, "evaluation_weights", None)
    with weights(state.model) if weights is not None else contextlib.nullcontext():
        return evaluate(
            runner.task, state.model, pipeline.eval_batches(split), prefix=split,
            device=state.loop.device, amp=runner.amp, global_step=state.loop.global_step,
            train_seed=runner.train_seed,
        )  # fmt: skip


def epoch_lr(progress, optimizer) -> float:
    """The lr the epoch's last step used (every lr the run reports is the one its step
    used); the optimizer's current lr for an epoch that ran no step."""
    return progress.step_lrs[-1] if progress.step_lrs else optimizer.param_groups[0]["lr"]


class StepFeed:
    """Hands per-step losses and lrs to the loggers in batches: one host read per batch,
    never one per step. Loggers are sinks of the same numbers metrics.jsonl holds."""

    def __init__(self, loggers, state: LoopState) -> None:
        self.loggers, self.state = loggers, state
        self.sent = len(state.progress.step_losses)  # a resumed epoch's steps were sent

    def flush(self) -> None:
        progress = self.state.progress
        if len(progress.step_losses) <= self.sent:
            return
        losses = torch.stack(progress.step_losses[self.sent :]).double().tolist()
        first = self.state.global_step - len(losses) + 1
        series = {"train_loss": losses, "lr": progress.step_lrs[self.sent :]}
        self.loggers.log_steps(list(range(first, self.state.global_step + 1)), series)
        self.sent = len(progress.step_losses)

    def every(self, steps: int) -> None:
        if steps and self.state.global_step % steps == 0:
            self.flush()

    def epoch(self, row: dict) -> None:
        self.loggers.log_epoch(row["epoch"], row["global_step"], row)
        self.sent = 0  # the loop state starts a fresh epoch

    def close(self, status: str) -> None:
        self.loggers.close(status)


def final_metrics(runner: StepRunner, pipeline, run_dir: Path) -> dict:
    """Last epoch's row plus the test split, evaluated once: last weights, then best."""
    state = runner.state.loop
    final = {k: v for k, v in state.metrics[-1].items() if k not in ("seconds", "images_per_s")}
    final.update(evaluate_split(runner, pipeline, "test"))
    best_path = run_dir / rec.CHECKPOINTS / "best.pt"
    if state.best_epoch not in (None, state.metrics[-1]["epoch"]) and best_path.is_file():
        best_state = checkpoint.load(best_path)
        runner.state.model.load_state_dict(best_state["model"])
        if "step" in best_state and runner.state.step is not None:  # its EMA weights too
            runner.state.step.load_state_dict(best_state["step"])
        best = evaluate_split(runner, pipeline, "test")
        final.update({f"best_{k}": v for k, v in best.items()}, best_epoch=state.best_epoch)
    return final


# ------------------------------------------------------------------------------- the entry


_lock: RunMutex | None = None


def release_lock() -> None:
    global _lock
    if _lock is not None:
        _lock.release()
        _lock = None


@hydra.main(config_path=str(REPO_ROOT / "conf"), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    global _lock
    preflight.register_resolvers()  # joblib/submitit workers never ran cli()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    dist = None
    try:
        dist = init_from_env(cfg.trainer.device)
        run_dir = Path(dist.broadcast_object(str(run_dir)))  # one run dir, decided by rank 0
        rec.set_writer(dist.is_main)
        if not dist.is_main:
            log.setLevel(logging.WARNING)  # one log: rank 0's
        refused = None
        cfg.resume = launchers.default_resume(cfg.resume)  # auto inside a submitit job
        if dist.is_main:
            try:
                _lock = RunMutex(run_dir).acquire()  # one writer per run dir, for its lifetime
                run_dirs.refuse_reuse(run_dir, cfg.resume)  # written once (rank 0 decides)
            except ResumeError as e:
                refused = str(e)
        if (refused := dist.broadcast_object(refused)) is not None:
            raise ResumeError(refused)
        return train(cfg, run_dir, dist)
    except AlreadyCompleted as e:
        print(str(e), file=sys.stderr)
        sys.exit(0)
    except ResumeError as e:  # refused before touching anything: leave the record as it was
        _error(dist, str(e))
        sys.exit(e.exit_code)
    except ReprotrainError as e:
        _mark(run_dir, "failed", error=str(e), **getattr(e, "record", {}))
        _log_error(str(e))
        _error(dist, str(e))
        sys.exit(e.exit_code)
    except OSError as e:  # disk full, a path that is a file, a name too long: name it
        if worker_death.is_worker_death(e):  # a killed worker's socket reset first
            _worker_died(run_dir, dist, e)
        where = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        message = f"{where}: {e.strerror or e}" if where else str(e)
        _mark(run_dir, "failed", error=message)
        _log_error(message)
        _error(dist, message)
        sys.exit(2)
    except KeyboardInterrupt:
        _mark(run_dir, "interrupted", error="aborted by a second SIGINT")
        print("aborted: previous checkpoints are intact", file=sys.stderr)
        sys.exit(EXIT_ABORTED)
    except RuntimeError as e:
        if not worker_death.is_worker_death(e):
            _mark(run_dir, "failed", error=f"{type(e).__name__}: {e}")
            raise
        _worker_died(run_dir, dist, e)
    except Exception as e:
        _mark(run_dir, "failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        worker_death.stop_workers()  # loader workers ignore SIGTERM: never wait on them
        release_lock()
        if dist is not None:
            dist.destroy()


def _worker_died(run_dir: Path, dist: Dist | None, e: BaseException) -> NoReturn:
    """A DataLoader worker was killed (data/worker_death.py): interrupted, resumable."""
    died = worker_death.describe(e)
    _mark(run_dir, "interrupted", interrupted_by="DataLoader worker died", error=died)
    message = (
        f"{died} (killed from outside, e.g. by the OOM killer); the run stopped at its last "
        f"checkpoint: resume with `{resume_hint(run_dir)}`"
    )
    _log_error(message)
    _error(dist, message)
    worker_death.stop_workers()
    sys.exit(EXIT_INTERRUPTED)


def _error(dist: Dist | None, message: str) -> None:
    if dist is None or dist.is_main:
        print(f"error: {message}", file=sys.stderr)


def _mark(run_dir: Path, status: str, **fields: Any) -> None:
    """Record a failure without ever masking the original error."""
    try:
        path = run_dir / rec.RUN_JSON
        record = rec.RunRecord.load(run_dir) if path.exists() else rec.RunRecord(run_dir)
        try:
            record.update(status=status, finished_at=rec.now_iso(), **fields)
        except OSError:  # no room for a new file (disk full): reuse run.json's own blocks
            rec.write_in_place(path, rec.strict_json(record.data, indent=2).encode())
    except Exception as e:  # pragma: no cover - best effort
        print(f"warning: could not update run.json: {e}", file=sys.stderr)


def _log_error(message: str) -> None:
    """The error into train.log too; a log that cannot be written (a full disk) stays quiet
    rather than printing logging's own traceback."""
    raising, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        log.error(message)
    finally:
        logging.raiseExceptions = raising


def cli() -> None:
    """Console entry: fix the hash seed, check the overrides in one line, run Hydra."""
    launchers.die_with_parent()
    hashseed.ensure()
    preflight.cli_check()
    main()


if __name__ == "__main__":
    cli()
