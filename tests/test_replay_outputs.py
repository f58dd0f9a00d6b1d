"""A resume's replay runs the run's own steps through ``Silent`` outputs (loop.py): no bar,
checkpoint, row, record update, event, log line or continuation line; callbacks see
``replaying=True``; ``stop_at_global_step`` does not stop it, a signal does (uncheckpointed).
The live ``Outputs`` is back once it ends. In process, on the step harness: seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reprotrain import events
from reprotrain.callbacks import Callback, Callbacks
from reprotrain.config import GuardSettings, LoopSettings
from reprotrain.distributed import Dist
from reprotrain.loop import Interrupted, LossFeed, Outputs, Silent, Trainer
from step_harness import Harness, batch


class Seen(Callback):
    """Each hook's name and what its context says about replaying."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def on_start(self, ctx) -> None:
        self.calls.append(("on_start", ctx.replaying))

    def on_checkpoint(self, ctx, path) -> None:
        self.calls.append(("on_checkpoint", ctx.replaying))

    def on_epoch_end(self, ctx, row) -> None:
        self.calls.append(("on_epoch_end", ctx.replaying))


class Pipeline:
    def __init__(self, steps: int) -> None:
        self.steps_per_epoch = steps

    def epoch(self, epoch: int, start: int = 0):
        return ((s, batch(s)) for s in range(start, self.steps_per_epoch))

    def has_split(self, split: str) -> bool:
        return False


class Saver:
    def __init__(self, root) -> None:
        self.dir, self.saved = root / "checkpoints", []

    def save(self, **kw) -> None:
        self.saved.append(kw)

    def payload(self) -> dict:
        return {"saved": len(self.saved)}


def trainer(tmp_path, seen: Seen) -> tuple[Trainer, list]:
    h = Harness()
    h.state.callbacks = Callbacks({"seen": seen}, torch.device("cpu"))
    updates: list[dict] = []
    record = SimpleNamespace(run_dir=tmp_path, data={}, update=lambda **kw: updates.append(kw))
    settings = LoopSettings(epochs=1, progress=False, monitor="train_loss", monitor_mode="min",
                            checkpoint_every_steps=2, stop_at_global_step=3)  # fmt: skip
    both = SimpleNamespace(loop=settings, guard=GuardSettings("stop", 1))
    stop = SimpleNamespace(signal_name=None)
    run = SimpleNamespace(record=record, stop=stop, dist=Dist(), settings=both)
    parts = SimpleNamespace(runner=h.runner, pipeline=Pipeline(6), saver=Saver(tmp_path),
                            schedule=None)  # fmt: skip
    return Trainer(run, parts, SimpleNamespace(log_every_steps=0)), updates


def test_a_replay_leaves_nothing_and_its_callbacks_know(tmp_path):
    seen = Seen()
    t, updates = trainer(tmp_path, seen)
    fired: list[str] = []
    forget = [events.on(e, lambda e=e, **kw: fired.append(e)) for e in ("step", "after-save")]
    try:
        live = t.out
        payload = t.replay_state((2, 0))  # the whole epoch, past stop_at_global_step=3
        assert payload == {"saved": 0} and t.loop.global_step == 6 and t.out is live
        assert t.saver.saved == [] and updates == [] and fired == [] and t.saved_at == 6
        assert not list(tmp_path.iterdir())  # no metrics, fingerprints or continuation file
        assert seen.calls and all(replaying for _, replaying in seen.calls)
        hooks = [name for name, _ in seen.calls]
        assert hooks == ["on_start", "on_checkpoint", "on_checkpoint", "on_epoch_end",
                         "on_checkpoint"]  # fmt: skip
    finally:
        for f in forget:
            f()


def test_the_live_outputs_write_what_the_replay_does_not(tmp_path):
    seen = Seen()
    t, updates = trainer(tmp_path, seen)
    t.out.feed = LossFeed(SimpleNamespace(close=lambda status: None), t.loop)
    fired: list[str] = []
    forget = events.on("step", lambda **kw: fired.append("step"))
    try:
        with pytest.raises(Interrupted):
            t.run_epoch()  # stop_at_global_step=3: checkpointed, then interrupted
    finally:
        forget()
    assert isinstance(t.out, Outputs) and not isinstance(t.out, Silent)
    assert len(t.saver.saved) == 2 and fired == ["step"] * 3  # step 2's cadence, the stop's
    assert updates[-1]["status"] == "interrupted"
    assert (tmp_path / "continuation.jsonl").is_file()
    assert not any(replaying for _, replaying in seen.calls)


def test_a_signal_stops_a_replay_uncheckpointed(tmp_path):
    class SignalAtStep2(Seen):
        def on_train_batch_end(self, ctx, global_step: int) -> None:
            if global_step == 2:
                t.stop.signal_name = "SIGTERM"

    t, updates = trainer(tmp_path, SignalAtStep2())
    with pytest.raises(Interrupted):
        t.replay_state((2, 0))
    assert t.saver.saved == [] and t.loop.global_step == 2 and not list(tmp_path.iterdir())
    (update,) = updates
    assert update["status"] == "interrupted" and update["interrupted_by"] == "SIGTERM"
