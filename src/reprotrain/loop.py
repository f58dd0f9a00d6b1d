"""The training loop as one object: ``Trainer(run, parts, ...).fit()`` (docs/how-a-run-flows.md).

Closes: resume drift at a stop: a stop comes after a whole step, at the same global step on
every rank, checkpointed after a non-finite read (docs/resume.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from typing import Any

import torch

from reprotrain import events, optim
from reprotrain.build import Parts
from reprotrain.callbacks import CallbackContext, Callbacks
from reprotrain.hashing import losses_sha256, state_sha256, weights_sha256
from reprotrain.loggers import CallbackLog, Logger, build_loggers, resumed_history
from reprotrain.profiling import Profiler
from reprotrain.progress import EpochBar
from reprotrain.quoting import resume_hint
from reprotrain.repro import checkpoint, determinism, environment
from reprotrain.repro import precision as float_math
from reprotrain.resume.continuation import FILE, Continuation, record_verdict
from reprotrain.run import record as rec
from reprotrain.run.report import write_report
from reprotrain.start import Run, StopFlag
from reprotrain.state import LoopState
from reprotrain.step.runner import (
    NonFiniteFlags,
    StepRunner,
    epoch_metrics,
    evaluate,
    nonfinite,
    train_step,
)

log = logging.getLogger("reprotrain")


class Interrupted(Exception):
    """The loop stopped on a request after checkpointing; the record says interrupted."""

    def __init__(self, stop: StopFlag) -> None:
        super().__init__(stop.signal_name)
        self.stop = stop


class Trainer:
    """The loop over a built run: ``fit()`` returns the monitored best value."""

    def __init__(self, run: Run, parts: Parts, logger_cfg: Any) -> None:
        self.runner, self.pipeline, self.saver = parts.runner, parts.pipeline, parts.saver
        self.schedule = parts.schedule  # the lr schedule over any number of epochs
        self.record, self.stop, self.dist = run.record, run.stop, run.dist
        self.settings, self.guard = run.settings.loop, run.settings.guard
        self.logger_cfg, self.run_dir = logger_cfg, run.record.run_dir
        self.log_every_steps = int(logger_cfg.log_every_steps)  # a config read is ~20 us: once
        self.loop: LoopState = parts.runner.state.loop
        self.alerts: list[str] = list(run.record.data.get("nondeterministic_ops", []))
        self.bar = EpochBar(self.settings.progress, epochs=self.settings.epochs)
        self.profiler: Profiler | None = None
        self.saved_at: int | None = None  # the global step of the last checkpoint (or replayed)
        # The steps since the last checkpoint, for a resume to compare (rank 0 writes them).
        self.continuation = Continuation(self.run_dir / FILE if run.dist.is_main else None)
        self.callbacks = parts.runner.state.callbacks or Callbacks({}, self.loop.device)
        self.out: Outputs = Outputs(self)  # what the run leaves; a replay swaps in Silent

    def fit(self) -> float | None:
        """Epochs from the loop state's position, then the test split once; the best value."""
        state, settings, progress = self.loop, self.settings, self.loop.progress
        logged = self.out.logged = CallbackLog(self.run_dir if self.dist.is_main else None,
                                               state.global_step)  # fmt: skip
        history = resumed_history(state.fingerprints, state.metrics, progress.losses(),
                                  progress.step_lrs, state.global_step, logged.lines)  # fmt: skip
        # MLflow attaches report.md and curves.png at the end, drawn by make report's writer.
        sinks = build_loggers(self.logger_cfg, self.run_dir, self.record.data, state.global_step,
                              history, report=write_report)  # fmt: skip
        self.out.feed = LossFeed(sinks, state, self.runner.reduction, self.callbacks, logged)
        self.callback("on_start")
        if settings.profile_steps and self.dist.is_main:
            where = self.run_dir / "profile"
            self.profiler = Profiler(where, settings.profile_steps, state.device).start()
        with determinism.nondeterminism_alerts(self.alerts):
            while state.epoch <= settings.epochs and state.early_stopped is None:
                self.run_epoch()
                if settings.stop_after_epoch and state.epoch > settings.stop_after_epoch:
                    break  # spot check: the schedule still spans trainer.epochs
        self.bar.close()
        if self.profiler is not None:
            log.info("top ops (%s):\n%s", self.profiler.table_path, self.profiler.stop())
        return self.finish()

    def replay_state(
        self, target: tuple[int, int], epochs: int | None = None, from_start: bool = False
    ) -> dict | None:
        """Re-run the steps up to ``target`` ``(epoch, epoch_step)`` through :class:`Silent`,
        under the run's length then (``epochs``); the checkpoint payload the state then makes."""
        state, settings, scheduler = self.loop, self.settings, self.runner.state.scheduler
        live, self.out = self.out, Silent(self)
        if epochs is not None and epochs != settings.epochs:
            self.settings = dataclasses.replace(settings, epochs=epochs)
            schedule = self.schedule
            past = schedule.over(epochs) if from_start else schedule.resumed(epochs, scheduler)
            self.runner.state.scheduler = past
        try:
            # The run's own life: its on_start (set-up such as freezing a layer) ran before
            # these steps; the hooks between are called where the run called them (``save``).
            self.callback("on_start")
            with determinism.nondeterminism_alerts([]):
                while (state.epoch, state.epoch_step) < target:
                    self.run_epoch(until=target[1] if state.epoch == target[0] else None)
            return self.saver.payload()
        finally:
            self.out, self.settings, self.runner.state.scheduler = live, settings, scheduler

    def run_epoch(self, until: int | None = None) -> dict:
        """One epoch from ``(epoch, step)`` then its end (``until``: stop at that step, a
        replay); no host sync per step, only at the sync points (docs/performance.md)."""
        state, steps, out = self.loop, self.pipeline.steps_per_epoch, self.out
        out.bar.start(state.epoch, steps, state.epoch_step)
        seen_before = state.progress.seen
        self.runner.forward.train()
        flags = NonFiniteFlags(state.progress)
        every = self.guard.nonfinite_check_every
        t0 = time.perf_counter()
        for step, batch in self.pipeline.epoch(state.epoch, state.epoch_step):
            flags.add(train_step(self.runner, step, batch))
            out.continuation.add(state.global_step, state.progress.step_losses[-1], batch)
            synced = None  # whether any rank saw a stop signal, at a sync point
            due = state.global_step % every == 0
            if due or self.saves_at(state.global_step):
                synced = self.sync_point(flags)
            if due:
                out.log_steps()  # the device was just read: no extra sync
            self.after_step(step + 1, synced)
            if until is not None and state.epoch_step == until:
                return {}
        seconds = time.perf_counter() - t0
        self.sync_point(flags)
        out.log_steps()  # this rank's step losses, before the reduction makes them global
        self.runner.reduction.end_epoch(state.progress)  # the epoch's losses and sums, global
        out.feed.flush()
        trained = state.progress.seen - self.runner.reduction.global_count(seen_before)
        row = self.end_epoch(seconds, trained)
        out.epoch_logged(row, self.callbacks.take_logged())  # + ctx.log's: loggers only
        if state.epoch <= self.settings.epochs:  # the last epoch's end completes the run
            self.stop_if_asked(self.stop_at_reached())
        return row

    def sync_point(self, flags: NonFiniteFlags) -> bool:
        """The non-finite guard's read and whether any rank saw a stop signal (one sync)."""
        signal = self.stop.signal_name is not None
        bad, signalled = self.dist.all_reduce_flags(flags.read(), signal)
        if bad:
            nonfinite(self.loop, self.guard.on_nonfinite)
        return signalled

    def saves_at(self, global_step: int) -> bool:
        """Whether a checkpoint may be written after ``global_step`` (the same on all ranks)."""
        every, stop_at = self.settings.checkpoint_every_steps, self.settings.stop_at_global_step
        return bool(every and global_step % every == 0) or global_step == stop_at

    def stop_at_reached(self) -> bool:
        stop_at = self.settings.stop_at_global_step
        return bool(stop_at) and self.loop.global_step == stop_at

    def after_step(self, next_step: int, synced: bool | None = None) -> None:
        """Progress, loggers, stops and the cadence checkpoint; ``synced``: a stop signal on
        any rank, from this step's sync point (None: not one; DDP stops only there)."""
        state, out, mid_epoch = self.loop, self.out, next_step < self.pipeline.steps_per_epoch
        out.bar.step(state.progress, state.global_step)
        if self.callbacks.per_batch:  # found once: no call per step without one
            self.callback("on_train_batch_end", state.global_step)  # before its values are sent
        out.feed.every(self.log_every_steps, mid_epoch)  # DDP: a collective
        if self.profiler is not None:
            self.profiler.step()
        out.fire("step", global_step=state.global_step)
        signalled = self.stop.signal_name is not None if not self.dist.enabled else bool(synced)
        self.stop_if_asked(self.stop_at_reached() and mid_epoch, signalled)
        if self.cadence_due():
            self.save()

    def cadence_due(self) -> bool:
        """Whether an uninterrupted run writes a mid-epoch cadence checkpoint after this step."""
        every, state = self.settings.checkpoint_every_steps, self.loop
        mid_epoch = 0 < state.epoch_step < self.pipeline.steps_per_epoch
        return bool(every) and state.global_step % every == 0 and mid_epoch

    def stop_if_asked(self, asked: bool, signalled: bool | None = None) -> None:
        """The one place a run stops early: a signal on any rank (``signalled``, else one
        all-reduce asks) or ``asked`` (``Outputs.stop``: checkpointed; a replay's, not)."""
        if signalled is None:
            signalled = self.dist.all_reduce_any(self.stop.signal_name is not None)
        if signalled or asked:
            self.out.stop(signalled)

    def end_epoch(self, seconds: float, n: int) -> dict:
        """Metrics row, fingerprint, checkpoint (best.pt when the monitored value improved)."""
        state, settings, runner = self.loop, self.settings, self.runner
        row = {
            "epoch": state.epoch,
            "global_step": state.global_step,
            **epoch_metrics(runner.task, state.progress),
            "lr": epoch_lr(state.progress.step_lrs, runner.state.optimizer),
            "seconds": seconds,
            "images_per_s": n / seconds if seconds > 0 else None,
        }
        last = state.epoch == settings.epochs or state.epoch == settings.stop_after_epoch
        if self.pipeline.has_split("val") and (state.epoch % settings.eval_every == 0 or last):
            row.update(evaluate_split(runner, self.pipeline, "val", self.out.bar))
        state.metrics.append(row)
        # What a callback keeps (or edits in the weights) is in the fingerprint and checkpoint,
        # and so is the stop it asks for (early stopping).
        asked = self.callback("on_epoch_end", row)
        if asked is not None and asked.stop_reason and state.epoch < settings.epochs:
            state.early_stopped = {"epoch": state.epoch, **asked.stop_reason}
        float_math.check_unchanged()  # torch's fp32_precision settings still the run's
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
        value = row.get(settings.monitor)
        improved = state.improved(value, settings.monitor_mode)
        optim.epoch_end(runner.state.scheduler, value)  # ReduceLROnPlateau: on the monitor
        self.out.epoch_rows(row)
        state.next_epoch()  # the epoch-end checkpoint resumes at the start of the next epoch
        self.save(best=improved, model_state=cpu_state)
        self.out.fire("after-save", global_step=state.global_step)
        return row

    def save(self, best: bool = False, model_state: dict | None = None, hook: bool = True) -> None:
        """``on_checkpoint`` (``hook``: where an uninterrupted run writes one), then the
        checkpoint (``Outputs.checkpoint``)."""
        path = checkpoint.step_path(self.saver.dir, self.loop.global_step)
        if hook:
            self.callback("on_checkpoint", path)
        self.saved_at = self.loop.global_step
        self.out.checkpoint(best, model_state)
        if hook:
            self.out.written(path)

    def callback(self, hook: str, *args: Any) -> CallbackContext | None:
        """Every callback's ``hook`` (each inside the RNG guard: callbacks.py); its context."""
        if not self.callbacks:
            return None
        state, loop = self.runner.state, self.loop
        ctx = CallbackContext(state.model, state.optimizer, loop.epoch, loop.global_step,
                              self.run_dir, self.out.replaying, self.dist.is_main)  # fmt: skip
        return self.callbacks.call(hook, ctx, *args)

    def finish(self) -> float | None:
        """Test once (last weights, then best), mark the run completed; the monitored best."""
        state, settings, out = self.loop, self.settings, self.out
        out.log_steps(stopped=True)
        self.continuation.close()
        final = self.final_metrics()
        self.record.update(
            status="completed",
            finished_at=rec.now_iso(),
            final_metrics=final,
            epochs_completed=len(state.metrics),
            partial=len(state.metrics) < settings.epochs,
            early_stopped=state.early_stopped,
            nondeterministic_ops=self.alerts,
            nonfinite_events=state.nonfinite_events,
            gpu_memory=environment.peak_memory(state.device),
        )
        out.feed.loggers.log_final(final)
        self.callback("on_end", final)
        # The weights the run ends with: after the last epoch's hooks and on_end's.
        self.record.update(final_weights_sha256=weights_sha256(self.runner.state.model))
        out.feed.loggers.close("completed")
        shown = "  ".join(f"{k}={v}" for k, v in final.items() if k.startswith("test_"))
        log.info("%s  %s=%s (best epoch %s)", shown, settings.monitor, state.best, state.best_epoch)
        log.info(
            "completed: checkpoints in %s; report: make report RUN=%s", self.saver.dir, self.run_dir
        )
        return state.best

    def final_metrics(self) -> dict:
        """Last epoch's row plus the test split, evaluated once: last weights, then best."""
        state, runner = self.loop, self.runner
        final = {k: v for k, v in state.metrics[-1].items() if k not in ("seconds", "images_per_s")}
        final.update(evaluate_split(runner, self.pipeline, "test", self.bar))
        best_path = self.run_dir / rec.CHECKPOINTS / "best.pt"
        if state.best_epoch not in (None, state.metrics[-1]["epoch"]) and best_path.is_file():
            best_state, last = checkpoint.load(best_path), self.weights()
            self.load_weights(best_state)
            best = evaluate_split(runner, self.pipeline, "test", self.bar)
            final.update({f"best_{k}": v for k, v in best.items()}, best_epoch=state.best_epoch)
            self.load_weights(last)  # the run ends with its last weights, not the best
        return final

    def weights(self) -> dict:
        """A copy of the model's weights and the user's step's state, as a checkpoint holds them."""
        state = self.runner.state
        saved = {"model": copy.deepcopy(state.model.state_dict())}
        if hasattr(state.user_step, "state_dict"):
            saved["user_step"] = copy.deepcopy(state.user_step.state_dict())
        return saved

    def load_weights(self, saved: dict) -> None:
        """The model's weights and the user's step's state (its EMA weights) of a checkpoint."""
        state = self.runner.state
        state.model.load_state_dict(saved["model"])
        if "user_step" in saved and state.user_step is not None:
            state.user_step.load_state_dict(saved["user_step"])


class Outputs:
    """All a run leaves as it trains, in one place: the bar, log lines, checkpoints, the
    metrics and fingerprint rows, record updates, events, the continuation file and the
    loggers' feed. A replay swaps in :class:`Silent`: the same steps, nothing left."""

    replaying = False  # what a callback's context says

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.bar, self.continuation = trainer, trainer.bar, trainer.continuation
        self.feed: Any = None  # the loggers' feed: set by fit()
        self.logged: CallbackLog = CallbackLog(None)  # what callbacks logged: set by fit()

    fire = staticmethod(events.fire)  # ``step``, ``after-save``: what tests and tools hook

    def log_steps(self, stopped: bool = False) -> None:
        """The steps since the last host read into the continuation file; its verdict, once
        known, into the record (docs/resume.md)."""
        self.continuation.flush()
        if (verdict := self.continuation.verdict(stopped)) is not None:
            record_verdict(self.trainer.record, verdict, self.continuation.claim)

    def epoch_rows(self, row: dict) -> None:
        """metrics.jsonl, fingerprints.jsonl, the epoch's log line (and an early stop's)."""
        t, state = self.trainer, self.trainer.loop
        rec.write_jsonl(t.run_dir / rec.METRICS, state.metrics)
        rec.write_jsonl(t.run_dir / rec.FINGERPRINTS, state.fingerprints)
        shown = "  ".join(f"{k}={v:.4g}" for k, v in row.items() if k != "epoch" and v is not None)
        log.info("epoch %d/%d  %s", state.epoch, t.settings.epochs, shown)
        if state.early_stopped is not None:
            log.info("early stopping after epoch %d: %s", state.epoch, state.early_stopped["why"])

    def epoch_logged(self, row: dict, extra: dict) -> None:
        """The epoch's row and what callbacks logged (``extra``, under names the row lacks)
        to the loggers; the alerts and non-finite events to the record."""
        self.logged.add({row["global_step"]: extra}, epoch=row["epoch"])
        self.feed.epoch(extra | row)
        t = self.trainer
        t.record.update(nondeterministic_ops=t.alerts, nonfinite_events=t.loop.nonfinite_events)

    def checkpoint(self, best: bool, model_state: dict | None) -> None:
        self.log_steps()
        self.trainer.saver.save(best=best, model_state=model_state)
        self.continuation.restart()  # the steps up to here are in the checkpoint

    def written(self, path: Any) -> None:
        """``on_checkpoint_written``: the checkpoint ``on_checkpoint`` saw is on disk."""
        self.trainer.callback("on_checkpoint_written", path)

    def stop(self, signalled: bool) -> None:
        """Checkpoint (unless this step's is written), close the loggers, mark interrupted."""
        t = self.trainer
        stop_at = t.settings.stop_at_global_step
        t.stop.signal_name = t.stop.signal_name or f"trainer.stop_at_global_step={stop_at}"
        self.feed.loggers.close("interrupted")
        if t.saved_at != t.loop.global_step:  # an epoch end's stop: written already
            t.save(hook=t.cadence_due())
        self.log_steps(stopped=True)
        self.interrupted(f"interrupted at epoch {t.loop.epoch} step {t.loop.epoch_step}")

    def interrupted(self, where: str) -> None:
        t = self.trainer
        by = t.stop.signal_name
        t.record.update(status="interrupted", interrupted_at=rec.now_iso(), interrupted_by=by)
        log.warning("%s; resume with `%s`", where, resume_hint(t.run_dir))
        raise Interrupted(t.stop)


class Silent(Outputs):
    """A replay's outputs: no bar, line, checkpoint, row, record update, event or logger
    value (all were written when the steps first ran); a signal still stops it."""

    replaying = True

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.bar, self.continuation = trainer, EpochBar(False), Continuation(None)
        self.feed = LossFeed(Logger(), trainer.loop)  # the base logs nothing

    def _nothing(self, *args: Any, **kw: Any) -> None:
        """Written, logged or fired when the steps first ran."""

    fire = log_steps = epoch_rows = checkpoint = written = _nothing

    def epoch_logged(self, row: dict, extra: dict) -> None:
        self.feed.epoch(row)  # nothing was logged (``ctx.log`` while replaying)

    def stop(self, signalled: bool) -> None:
        """A signal stops a replay, uncheckpointed; ``stop_at_global_step`` does not."""
        if signalled:
            self.interrupted("interrupted while replaying")


def evaluate_split(
    runner: StepRunner, pipeline: Any, split: str, bar: EpochBar | None = None
) -> dict:
    """``<split>_<name>`` metrics under the user's step's ``evaluation_weights`` (EMA)."""
    state, loop = runner.state, runner.state.loop
    batches = pipeline.eval_batches(split)
    if bar is not None and bar.enabled:
        batches = bar.evaluating(split, batches, pipeline.eval_steps(split))
    weights = getattr(runner.user_step, "evaluation_weights", None)
    with weights(state.model) if weights is not None else contextlib.nullcontext():
        return evaluate(
            runner.task, state.model, batches, prefix=split, device=loop.device, amp=runner.amp,
            train_seed=runner.train_seed, global_step=loop.global_step,
        )  # fmt: skip


def epoch_lr(step_lrs: list[float], optimizer: torch.optim.Optimizer) -> float:
    """The lr the epoch's last step used (the optimizer's, if it ran none)."""
    return step_lrs[-1] if step_lrs else optimizer.param_groups[0]["lr"]


class LossFeed:
    """Per-step losses and lrs to the loggers in batches: one host read per batch (mid-epoch
    under DDP, one all-reduce of a copy: ``Reduction.global_step_losses``)."""

    def __init__(
        self, loggers: Any, state: LoopState, reduction: Any = None, callbacks: Any = None,
        logged: CallbackLog | None = None,
    ) -> None:  # fmt: skip
        self.loggers, self.state, self.reduction = loggers, state, reduction
        self.callbacks, self.logged = callbacks, logged  # per-step ctx.log values, and their file
        self.sent = len(state.progress.step_losses)  # a resumed epoch's steps were sent

    def flush(self, mid_epoch: bool = False) -> None:
        progress = self.state.progress
        if len(progress.step_losses) <= self.sent:
            return
        stacked = torch.stack(progress.step_losses[self.sent :])
        if mid_epoch and self.reduction is not None:
            stacked = self.reduction.global_step_losses(stacked)
        losses = stacked.double().tolist()
        steps = list(range(self.state.global_step - len(losses) + 1, self.state.global_step + 1))
        series = {"train_loss": losses, "lr": progress.step_lrs[self.sent :]}
        if self.callbacks:  # what on_train_batch_end logged, at its step
            taken = self.callbacks.take_steps(self.state.global_step)
            self.logged.add(taken)
            for name in dict.fromkeys(k for values in taken.values() for k in values):
                series[name] = [taken.get(s, {}).get(name) for s in steps]
        self.loggers.log_steps(steps, series)
        self.sent = len(progress.step_losses)

    def every(self, steps: int, mid_epoch: bool = True) -> None:
        """A batch every ``steps`` global steps mid-epoch, if the config chose a logger (so
        every rank joins the same collectives)."""
        due = steps and self.state.global_step % steps == 0
        if due and mid_epoch and getattr(self.loggers, "configured", ()):  # a stub: none
            self.flush(mid_epoch=True)
            self.loggers.end_batch(self.state.global_step)

    def epoch(self, row: dict) -> None:
        self.loggers.log_epoch(row["epoch"], row["global_step"], row)
        self.sent = 0  # the loop state starts a fresh epoch


__all__ = ["Interrupted", "LossFeed", "Outputs", "Silent", "Trainer", "evaluate_split"]
