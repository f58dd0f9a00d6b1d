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

import logging
import signal
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from reprotrain import REPO_ROOT, launchers, preflight, provenance
from reprotrain.build import (
    build_data,
    build_training,
    callbacks_for,
    components_record,
    schedule_for,
)
from reprotrain.config import TrainerSettings, microbatches_per_step, validate
from reprotrain.config_view import start_banner, task_overrides
from reprotrain.data import worker_death
from reprotrain.data.purity import check_samples
from reprotrain.distributed import Dist, init_from_env
from reprotrain.errors import ReprotrainError, ResumeError
from reprotrain.loop import Interrupted, StopFlag, Trainer
from reprotrain.quoting import resume_hint
from reprotrain.reduction import for_run
from reprotrain.repro import checkpoint, determinism, environment, secrets
from reprotrain.repro.seeding import seed_globals
from reprotrain.resume.audit import ResumeAudit
from reprotrain.resume.guard import AlreadyCompleted
from reprotrain.run import directory as run_dirs
from reprotrain.run import record as rec
from reprotrain.run.mutex import RunMutex
from reprotrain.run.report import write_report
from reprotrain.start import begin

log = logging.getLogger("reprotrain")
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: "try again later", what a requeue wrapper looks for
EXIT_ABORTED = 130


def train(cfg: DictConfig, run_dir: Path, dist: Dist) -> float | None:
    # --- compose: the resolved config is the run's identity (oc.env values as digests) ------
    # The batch layout against the world size this job has: compose time saw the launcher's
    # WORLD_SIZE, which a submitit job exports only once its tasks start.
    validate(cfg, dist.world_size)
    container, env_values = secrets.redact(cfg)
    start = begin(cfg.resume, run_dir, container)  # Fresh | Resume | Fork, decided once
    log.info("run dir: %s", run_dir)  # after the refusals: a refused resume writes nothing
    record = start.open_record(run_dir)
    provenance.open_run(record, container, env_values)
    stop = StopFlag()

    # --- controls: determinism level, seeds, device, environment ---------------------------
    settings = TrainerSettings.from_config(cfg.trainer)  # each part goes to what reads it
    flags = determinism.apply(
        cfg.repro.level, cfg.repro.num_threads, cfg.repro.fill_uninitialized_memory,
        settings.step.precision,
    )  # fmt: skip
    seeds = start.seeds(cfg.seed)
    device = start.device(record, settings.run.device, settings.run.allow_device_change,
                          dist.local_rank if dist.enabled else None)  # fmt: skip
    env = environment.capture(device)
    reduction = for_run(settings.reduction, dist)
    start.check_world_size(reduction, settings.reduction.allow_world_size_change)
    start.write_identity(
        record, device, seeds=seeds, flags=flags, env=env, repro=cfg.repro,
        name=OmegaConf.to_container(cfg, resolve=False)["name"],  # an oc.env stays text
        include_untracked=list(cfg.include_untracked),
    )  # fmt: skip
    k = microbatches_per_step(settings.pipeline.batch_size, settings.step.microbatch_size)
    provenance.layout(record, dist, device, reduction, k)
    log.info(
        "experiment %s | repro=%s | seeds %s | device %s | world size %d",
        record["experiment_id"], flags["level"], seeds.as_dict(), device, dist.world_size,
    )  # fmt: skip
    log.info("%s", start_banner(container, task_overrides(), run_dir / rec.RESOLVED_CONFIG))

    # --- build: data, then model (from the `init` stream), optimizer, schedule, task -------
    dataset, pipeline = build_data(
        cfg.dataset, cfg.model.get("num_classes"), settings.pipeline, seeds, device,
        rank=dist.rank, world_size=dist.world_size, channels_last=settings.model.channels_last,
        microbatch_collate=reduction.microbatch_collate(settings.pipeline.batch_size // k),
    )  # fmt: skip
    start.record_data(record, dataset.fingerprint())
    check_samples(pipeline, flags["level"], record)
    seed_globals(seeds.init)
    runner = build_training(
        cfg.model, cfg.optimizer, cfg.scheduler, cfg.task, cfg.loss, cfg.step,
        settings.model, settings.step, total_steps=pipeline.steps_per_epoch * settings.loop.epochs,
        device=device, reduction=reduction, train_seed=seeds.train,
    )  # fmt: skip
    state = runner.state
    state.callbacks = callbacks_for(cfg.callbacks, device, state.scheduler)  # conf/callbacks/
    record.update(components=components_record(settings.model, runner, dataset))
    state.audit = ResumeAudit(runner.task, dataset, state.model, device, state.user_step, dist,
                              trainer_state=state)  # fmt: skip

    # --- start: seed the `train` stream (a resume or fork then restores the state) ---------
    seed_globals(seeds.train)  # what an Exact resume re-derives (its checkpoint has no rng)
    meta = {"config": container, "config_sha256": record["config_sha256"]}
    meta |= {"seeds": seeds.as_dict(), "env": env}
    saver = checkpoint.Saver(
        run_dir / rec.CHECKPOINTS, state, meta, settings.run.keep_checkpoints,
        gather=reduction.checkpoint,
    )  # fmt: skip
    trainer = Trainer(runner, pipeline, saver, record, stop, dist, settings.loop, settings.guard,
                      logger_cfg=cfg.logger, report=write_report,
                      schedule_for=schedule_for(cfg.scheduler, state.optimizer,
                                                pipeline.steps_per_epoch))  # fmt: skip
    # A resume replays the steps since the checkpoint before its own and compares the bits.
    start.restore(state, record, env=env, device=device, container=container, dist=dist,
                  replay_state=trainer.replay_state,
                  continuation=trainer.continuation)  # fmt: skip
    meta["config_sha256"] = record["config_sha256"]  # a resume's extension enters it

    # --- loop and record: epochs, checkpoints on cadence and on signals, the test split ----
    with trainer.bar:  # closed before a stop's or an error's lines are written
        return trainer.fit()


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
    except Interrupted as e:  # checkpointed and recorded by the loop
        if e.stop.signal_name == "SIGUSR2" and e.stop.requeue is not None:
            release_lock()
            e.stop.requeue(signal.SIGUSR2, None)  # submitit requeues the job and exits
        sys.exit(EXIT_INTERRUPTED)
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
