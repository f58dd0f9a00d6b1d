"""Reference trainer: compose -> controls -> build -> loop -> record. Reads top to bottom.

    python -m reprotrain.train experiment=smoke            # or: make train ARGS="..."
    python -m reprotrain.train --multirun seed.base=0,1,2  # or: make sweep SEEDS=0,1,2

Exit codes: 0 completed; 2 user error (one line on stderr, run marked failed);
75 interrupted by SIGTERM/SIGINT after writing a checkpoint (resume with ``resume=auto``
or ``make resume``); 130 aborted by a second SIGINT (previous checkpoints still valid).
"""

from __future__ import annotations

import sys

from reprotrain.repro import hashseed

if __name__ == "__main__":
    # PYTHONHASHSEED is only read at interpreter start: re-exec now, before importing torch,
    # if it is not fixed. Also sets CUBLAS_WORKSPACE_CONFIG before any CUDA call. Then check
    # the overrides while it is still cheap: a typo fails in a second, in one line.
    hashseed.ensure()
    from reprotrain import preflight

    preflight.cli_check()

import logging
import signal
import time
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from reprotrain import preflight
from reprotrain.config import config_sha256, validate
from reprotrain.data.datasets import data_fingerprint, load_data
from reprotrain.data.pipeline import DevicePipeline, LoaderPipeline
from reprotrain.engine import EpochProgress, evaluate, train_step
from reprotrain.errors import ReprotrainError, ResumeError
from reprotrain.models.resnet import build_model
from reprotrain.optim import build_optimizer, build_scheduler
from reprotrain.paths import CONF_DIR, REPO_ROOT
from reprotrain.repro import checkpoint, determinism, environment, lockfile
from reprotrain.repro import record as rec
from reprotrain.repro.fingerprint import losses_sha256, weights_sha256
from reprotrain.repro.resume import find_resume_point, resume_entry
from reprotrain.repro.seeding import Seeds, resolve_seeds, seed_globals

log = logging.getLogger("reprotrain")
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: "try again later", what a requeue wrapper looks for
EXIT_ABORTED = 130


def config_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ReprotrainError("trainer.device=cuda but no CUDA device is visible; use cpu/auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class StopFlag:
    """SIGTERM/SIGINT ask the loop to stop after the current step; a second SIGINT aborts."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then checkpointing", self.signal_name)


def train(cfg: DictConfig, run_dir: Path) -> float:
    # --- compose: the resolved config is the run's identity --------------------------------
    validate(cfg)
    container = config_container(cfg)
    record = rec.RunRecord(run_dir)
    resume_point = find_resume_point(cfg.resume, run_dir, container)  # None: fresh start
    if resume_point is not None:
        record = rec.RunRecord.load(run_dir)
    record.update(status="running", config_sha256=config_sha256(container))
    rec.atomic_write_text(run_dir / rec.RESOLVED_CONFIG, OmegaConf.to_yaml(container))
    stop = StopFlag()
    stop.install()

    # --- controls: determinism level, seeds, device, environment ---------------------------
    flags = determinism.apply(
        cfg.repro.level, cfg.repro.num_threads, cfg.repro.fill_uninitialized_memory
    )
    seeds = Seeds(**resume_point.state["seeds"]) if resume_point else resolve_seeds(cfg.seed)
    device = pick_device(cfg.trainer.device)
    env = environment.capture(device)
    drift = lockfile.env_drift(REPO_ROOT)
    if drift["status"] == "drift":
        summary = ", ".join(
            drift["missing"] + drift["extra"] + [d["name"] for d in drift["different"]]
        )
        if cfg.repro.require_locked_env:
            raise ReprotrainError(f".venv differs from the lock ({summary}); run `make install`")
        log.warning("environment drift against the lock: %s (run `make env-check`)", summary)
    if resume_point is None:
        git, diff = environment.git_info(REPO_ROOT)
        if diff:
            rec.atomic_write_text(run_dir / "git.diff", diff)
        record.update(
            experiment_id=f"{record['config_sha256'][:8]}-{git['short']}"
            f"{'+dirty' if git['dirty'] else ''}-{environment.device_slug(device)}",
            run_dir=str(run_dir.resolve()),
            name=cfg.name,
            started_at=rec.now_iso(),
            command=["python", "-m", "reprotrain.train", *sys.argv[1:]],
            seeds=seeds.as_dict(),
            repro=flags,
            nondeterministic_ops=[],
            git=git,
            environment=env,
            lock_sha256=lockfile.lock_sha256(REPO_ROOT),
            env_drift=drift,
            container=lockfile.container_image(),
            resumes=[],
        )
        from torch.utils import collect_env

        rec.atomic_write_text(run_dir / "environment.txt", collect_env.get_pretty_env_info())

    # --- build: data, model (from the `init` stream), optimizer, schedule ------------------
    train_x, train_y, test_x, test_y = load_data(cfg.dataset)
    record.update(data_fingerprint=data_fingerprint(cfg.dataset))
    common = dict(
        batch_size=cfg.trainer.batch_size,
        eval_batch_size=cfg.trainer.eval_batch_size,
        mean=list(cfg.dataset.mean),
        std=list(cfg.dataset.std),
        device=device,
        seeds=seeds,
        augment=cfg.dataset.augment,
    )
    if cfg.trainer.pipeline == "device":
        pipeline = DevicePipeline(train_x, train_y, test_x, test_y, **common)
    else:
        pipeline = LoaderPipeline(
            train_x, train_y, test_x, test_y, num_workers=cfg.trainer.num_workers, **common
        )
    steps_per_epoch = pipeline.steps_per_epoch

    seed_globals(seeds.init)
    model = build_model(cfg.model).to(device)
    optimizer = build_optimizer(cfg.optimizer, model)
    scheduler = build_scheduler(cfg.scheduler, optimizer, steps_per_epoch * cfg.trainer.epochs)
    amp = (cfg.trainer.amp, cfg.trainer.amp_dtype)
    scaler = torch.amp.GradScaler(
        device.type,
        init_scale=cfg.trainer.amp_init_scale,
        enabled=cfg.trainer.amp and cfg.trainer.amp_dtype == "fp16",
    )
    loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.trainer.label_smoothing)
    eval_loss_fn = nn.CrossEntropyLoss()

    # --- resume or start: restore every state, or seed the `train` stream ------------------
    epoch, start_step, global_step = 1, 0, 0
    metrics: list[dict] = []
    fingerprints: list[dict] = []
    best_acc = -1.0
    progress = EpochProgress()
    if resume_point is not None:
        s = resume_point.state
        model.load_state_dict(s["model"])
        optimizer.load_state_dict(s["optimizer"])
        scheduler.load_state_dict(s["scheduler"])
        scaler.load_state_dict(s["scaler"])
        epoch, start_step, global_step = s["epoch"], s["step"], s["global_step"]
        metrics, fingerprints, best_acc = s["metrics"], s["fingerprints"], s["best_acc"]
        progress = EpochProgress(**s["progress"])
        checkpoint.set_rng_state(s["rng"])
        # The files may have run ahead of the checkpoint (killed after writing them).
        rec.write_jsonl(run_dir / rec.METRICS, metrics)
        rec.write_jsonl(run_dir / rec.FINGERPRINTS, fingerprints)
        entry = resume_entry(resume_point, env, device)
        record.update(
            resumes=[*record.data.get("resumes", []), entry], run_dir=str(run_dir.resolve())
        )
        log.info("resumed from %s at epoch %d step %d", resume_point.path.name, epoch, start_step)
    else:
        record.update(initial_weights_sha256=weights_sha256(model))
        seed_globals(seeds.train)

    ckpt_dir = run_dir / rec.CHECKPOINTS

    def snapshot(at_epoch: int, next_step: int) -> dict:
        """Everything a resume at (at_epoch, next_step) needs, RNG states included."""
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "epoch": at_epoch,
            "step": next_step,
            "global_step": global_step,
            "rng": checkpoint.rng_state(),
            "pipeline": {"kind": pipeline.kind, "epoch": at_epoch, "step": next_step},
            "progress": progress.as_dict(),
            "metrics": metrics,
            "fingerprints": fingerprints,
            "best_acc": best_acc,
            "seeds": seeds.as_dict(),
            "config": container,
            "config_sha256": record["config_sha256"],
            "env": checkpoint.env_summary(device),
        }

    def save_checkpoint(at_epoch: int, next_step: int) -> dict:
        state = snapshot(at_epoch, next_step)
        checkpoint.save(checkpoint.step_path(ckpt_dir, global_step), state)
        checkpoint.prune(ckpt_dir, cfg.trainer.keep_checkpoints)
        return state

    def interrupted(at_epoch: int, next_step: int) -> NoReturn:
        save_checkpoint(at_epoch, next_step)
        record.update(
            status="interrupted", interrupted_at=rec.now_iso(), interrupted_by=stop.signal_name
        )
        log.warning(
            "interrupted at epoch %d step %d; resume with `make resume RUN=%s`",
            at_epoch,
            next_step,
            run_dir,
        )
        sys.exit(EXIT_INTERRUPTED)

    # --- loop: epochs of counter-based batches; checkpoint on cadence and on signals -------
    nondeterministic_ops: list[str] = list(record.data.get("nondeterministic_ops", []))
    every = cfg.trainer.checkpoint_every_steps
    show_bar = cfg.trainer.progress and sys.stderr.isatty()
    with determinism.nondeterminism_alerts(nondeterministic_ops):
        while epoch <= cfg.trainer.epochs:
            t0, seen_before = time.perf_counter(), progress.seen
            model.train()
            bar = tqdm(
                total=steps_per_epoch,
                initial=start_step,
                desc=f"epoch {epoch}",
                disable=not show_bar,
                leave=False,
            )
            for step, x, y in pipeline.epoch(epoch, start_step):
                loss, correct = train_step(model, x, y, optimizer, scheduler, scaler, loss_fn, amp)
                progress.add(loss, correct, len(y))
                global_step += 1
                bar.update(1)
                checkpoint.test_hook("step", global_step)
                if stop.signal_name is not None:
                    interrupted(epoch, step + 1)
                if every and global_step % every == 0 and step + 1 < steps_per_epoch:
                    save_checkpoint(epoch, step + 1)
            bar.close()

            seconds = time.perf_counter() - t0
            row = {
                "epoch": epoch,
                "global_step": global_step,
                "train_loss": progress.loss_sum / progress.seen,
                "train_acc": progress.correct / progress.seen,
                "lr": scheduler.get_last_lr()[0],
                "seconds": seconds,
                "images_per_s": (progress.seen - seen_before) / seconds,
            }
            if epoch % cfg.trainer.eval_every == 0 or epoch == cfg.trainer.epochs:
                row.update(evaluate(model, pipeline.eval_batches(), eval_loss_fn, amp))
            metrics.append(row)
            fingerprints.append(
                {
                    "epoch": epoch,
                    "global_step": global_step,
                    "weights_sha256": weights_sha256(model),
                    "step_losses_sha256": losses_sha256(progress.step_losses),
                    "step_losses": progress.step_losses,
                }
            )
            rec.write_jsonl(run_dir / rec.METRICS, metrics)
            rec.write_jsonl(run_dir / rec.FINGERPRINTS, fingerprints)
            log.info(
                "epoch %d/%d  %s",
                epoch,
                cfg.trainer.epochs,
                "  ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch"),
            )

            # The epoch-end checkpoint resumes at the start of the next epoch.
            epoch, start_step, progress = epoch + 1, 0, EpochProgress()
            improved = row.get("test_acc", -1.0) > best_acc
            best_acc = max(best_acc, row.get("test_acc", -1.0))
            state = save_checkpoint(epoch, 0)
            if improved:
                checkpoint.save(ckpt_dir / "best.pt", state)
            checkpoint.test_hook("after-save", global_step)
            if nondeterministic_ops:
                record.update(nondeterministic_ops=nondeterministic_ops)
            if stop.signal_name is not None and epoch <= cfg.trainer.epochs:
                interrupted(epoch, 0)
            if cfg.trainer.stop_after_epoch and epoch > cfg.trainer.stop_after_epoch:
                break  # spot check: the schedule still spans trainer.epochs

    # --- record: the final state that a later verify/reproduce compares against -----------
    final = metrics[-1]
    record.update(
        status="completed",
        finished_at=rec.now_iso(),
        final_weights_sha256=weights_sha256(model),
        final_metrics={k: v for k, v in final.items() if k not in ("seconds", "images_per_s")},
        epochs_completed=len(metrics),
        partial=len(metrics) < cfg.trainer.epochs,
        nondeterministic_ops=nondeterministic_ops,
    )
    log.info("completed: %s  test_acc=%s", run_dir, final.get("test_acc"))
    return float(final.get("test_acc", 0.0))


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        return train(cfg, run_dir)
    except ResumeError as e:  # refused before touching anything: leave the record as it was
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except ReprotrainError as e:
        _mark(run_dir, "failed", error=str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _mark(run_dir, "interrupted", error="aborted by a second SIGINT")
        print("aborted: previous checkpoints are intact", file=sys.stderr)
        sys.exit(EXIT_ABORTED)
    except Exception as e:
        _mark(run_dir, "failed", error=f"{type(e).__name__}: {e}")
        raise


def _mark(run_dir: Path, status: str, **fields: Any) -> None:
    """Record a failure without ever masking the original error."""
    try:
        path = run_dir / rec.RUN_JSON
        record = rec.RunRecord.load(run_dir) if path.exists() else rec.RunRecord(run_dir)
        record.update(status=status, finished_at=rec.now_iso(), **fields)
    except Exception as e:  # pragma: no cover - best effort
        print(f"warning: could not update run.json: {e}", file=sys.stderr)


def cli() -> None:
    """Console entry: fix the hash seed, check the overrides in one line, run Hydra."""
    hashseed.ensure()
    preflight.cli_check()
    main()


if __name__ == "__main__":
    cli()
