"""The training loop's progress bar: the running loss on a terminal, nothing on a pipe, and
never a torn log line: opened at the first step, closed (erased) after the epoch's last,
and every log record written above it while it is open. The end-to-end check runs a real
training on a pseudo-terminal and reads the screen it leaves."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest
import torch

import faults
from conftest import MICRO, REFERENCE, REPO, TINY, assert_ok, base_env, jsonl, train
from reprotrain.progress import EpochBar
from reprotrain.state import EpochProgress
from terminal import on_a_pty, screen

#: A tqdm frame: ``epoch 1:  50%|#####     | 4/8 [00:00<00:00, 20.0it/s, loss=2.1]``.
BAR_FRAME = re.compile(r"\d+/\d+ \[\d\d:\d\d|it/s\]|\?it/s|\d+it \[")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress_with_losses(values: list[float]) -> EpochProgress:
    progress = EpochProgress(torch.device("cpu"))
    for v in values:
        progress.add(torch.tensor(v), {}, 1, 0.1)
    return progress


def test_on_a_terminal_the_bar_shows_the_mean_loss_of_the_last_steps(monkeypatch):
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    bar = EpochBar(enabled=True, every=2)
    bar.start(epoch=3, total=4, done=0)
    progress = progress_with_losses([9.0, 1.0, 3.0])
    bar.step(progress, global_step=2)  # reads the last two losses: (1 + 3) / 2
    bar.close()
    out = err.getvalue()
    assert "epoch 3" in out and "loss=2" in out


def test_the_bar_says_which_epoch_of_how_many():
    term = Terminal()
    bar = EpochBar(enabled=True, stream=term, epochs=3)
    bar.start(epoch=2, total=4, done=0)
    assert "epoch 2/3:" in term.getvalue()
    bar.close()


def test_an_evaluation_shows_its_batches_on_a_terminal_and_erases_its_bar():
    """One frame per batch counted on the host (k/N of the split's batches), no frame
    before the first batch, none left after the last: the epoch's log line comes next."""
    term = Terminal()
    bar = EpochBar(enabled=True, stream=term, epochs=2)
    batches = bar.evaluating("val", iter(["a", "b", "c"]), total=3)
    assert term.getvalue() == ""  # nothing drawn before the evaluation runs
    seen, counted = [], []
    for batch in batches:
        seen.append(batch)
        counted.append(bar._bar.tqdm.n)  # the batches done before this one
    assert seen == ["a", "b", "c"] and counted == [0, 1, 2] and not bar.is_open
    out = term.getvalue()
    assert re.search(r"val: +\d+%.*0/3", out)
    assert [line for line in screen(out) if line] == []


def test_off_a_terminal_or_with_progress_off_an_evaluation_is_its_batches_untouched():
    batches = iter([1, 2])
    for bar in (
        EpochBar(enabled=True, stream=io.StringIO()),
        EpochBar(enabled=False, stream=Terminal()),
    ):
        assert bar.evaluating("test", batches, total=2) is batches


def test_off_a_terminal_the_bar_writes_nothing_and_reads_no_loss(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    bar = EpochBar(enabled=True, every=1)
    bar.start(epoch=1, total=2, done=0)

    class Unreadable(list):
        def __getitem__(self, item):
            raise AssertionError("the bar read a loss off a terminal")

    progress = progress_with_losses([1.0])
    progress.step_losses = Unreadable(progress.step_losses)
    bar.step(progress, global_step=1)
    bar.close()
    assert err.getvalue() == ""


def test_the_bar_draws_nothing_before_the_first_epoch_and_erases_itself_after_the_last_step():
    term = Terminal()
    bar = EpochBar(enabled=True, every=100, stream=term)
    assert term.getvalue() == "" and not bar.is_open  # no `0it [00:00, ?it/s]` frame
    bar.start(epoch=1, total=2, done=0)
    assert "epoch 1" in term.getvalue() and bar.is_open
    progress = progress_with_losses([1.0, 2.0])
    bar.step(progress, global_step=1)
    bar.step(progress, global_step=2)
    assert not bar.is_open  # closed by the epoch's last step, before its log line
    assert [line for line in screen(term.getvalue()) if line] == []  # no frame left
    bar.close()  # idempotent: the loop's own close at the end of fit


def test_a_resumed_epoch_starts_at_its_step_and_a_finished_one_opens_no_bar():
    term = Terminal()
    bar = EpochBar(enabled=True, stream=term)
    bar.start(epoch=2, total=8, done=8)
    assert term.getvalue() == "" and not bar.is_open
    bar.start(epoch=2, total=8, done=5)
    assert "5/8" in term.getvalue()
    bar.close()


def test_only_rank_0_draws_a_bar_on_the_terminal_torchruns_ranks_share(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    term = Terminal()
    bar = EpochBar(enabled=True, stream=term)
    bar.start(epoch=1, total=4, done=0)
    assert term.getvalue() == "" and not bar.is_open
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    bar = EpochBar(enabled=True, stream=term)
    bar.start(epoch=1, total=4, done=0)
    assert "epoch 1" in term.getvalue()
    bar.close()


def test_a_log_record_while_the_bar_is_open_is_a_whole_line_above_it(monkeypatch):
    """The console handler (on sys.stderr, the bar's stream) goes through tqdm.write while
    the bar is open, keeps its level, and is given back when the bar closes."""
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    handler.setLevel(logging.INFO)
    log = logging.getLogger("reprotrain")
    monkeypatch.setattr(log, "handlers", [handler])
    monkeypatch.setattr(log, "propagate", False)
    # The suite's order must not decide the test: an earlier in-process run may have
    # disabled the logger (Hydra's disable_existing_loggers) or set a level whose answer
    # logging caches (setLevel clears that cache, assigning .level does not).
    monkeypatch.setattr(log, "disabled", False)
    monkeypatch.setattr(log, "level", log.level)  # put back afterwards
    log.setLevel(logging.DEBUG)
    bar = EpochBar(enabled=True, stream=term)
    bar.start(epoch=1, total=3, done=0)
    assert log.handlers != [handler]  # redirected while open
    log.info("checkpoint written")
    log.debug("below the handler's level")
    bar.step(progress_with_losses([1.0]), global_step=1)
    bar.close()
    assert log.handlers == [handler]
    assert [line for line in screen(term.getvalue()) if line] == ["[reprotrain] checkpoint written"]
    assert "below the handler's level" not in term.getvalue()


def run_on_a_pty(
    run_dir, *overrides: str, fault: str | None = None, evaluates: bool = False
) -> tuple[int, list[str]]:
    """A real training run with stdout and stderr on one pty (a user's shell), progress on:
    (exit code, the screen it leaves). ``evaluates``: the val and test evaluations drew
    their bars too."""
    args = [*overrides, "trainer.progress=true", f"hydra.run.dir={run_dir}"]
    cmd = faults.command(fault, "reprotrain.train", *args) if fault else [
        sys.executable, "-m", "reprotrain.train", *args]  # fmt: skip
    code, output = on_a_pty(cmd, cwd=REPO, env=base_env(), timeout=240)
    assert re.search(r"epoch 1/\d+: +\d+%\|", output), (
        f"no bar was drawn: nothing was tested\n{output}"
    )
    assert "0it [" not in output  # the bar opens with its epoch, not before the first lines
    for split in ("val", "test") if evaluates else ():
        assert re.search(rf"\r{split}: +\d+%\|", output), f"no {split} bar was drawn\n{output}"
    return code, [line for line in screen(output) if line]


def assert_whole_lines_and_no_bar(run_dir, shown: list[str]) -> None:
    """Every line of train.log is a whole line of the screen, none is torn, no frame is left."""
    logged = [line for line in (run_dir / "train.log").read_text().splitlines() if line.strip()]
    missing = [line for line in logged if line not in shown]
    torn = [line for line in shown if "][reprotrain][" in line and line not in logged]
    assert not missing and not torn, f"torn or lost log lines: {missing}\nscreen: {shown}"
    left = [line for line in shown if BAR_FRAME.search(line)]
    assert not left, f"a bar frame is left on screen: {left}"


def test_on_a_pseudo_terminal_every_log_line_is_whole_and_no_bar_is_left(tmp_path, reference_run):
    """Two epochs with a bar each (the second shows the loss, read at step 10), and a bar
    for each evaluation (val, test): after
    replaying the redraws and erasures, every line of train.log is whole on the screen
    (``logging to``, the epoch lines), no frame is left, and the weights are the reference
    run's, trained in a pipe (progress draws from no random stream)."""
    code, shown = run_on_a_pty(tmp_path / "run", *MICRO, *REFERENCE, evaluates=True)
    assert code == 0, shown[-20:]
    assert_whole_lines_and_no_bar(tmp_path / "run", shown)
    weights = [r["weights_sha256"] for r in jsonl(tmp_path / "run" / "fingerprints.jsonl")]
    assert weights == [r["weights_sha256"] for r in jsonl(reference_run / "fingerprints.jsonl")]


def test_on_a_pseudo_terminal_a_stops_lines_go_above_the_open_bar_and_it_is_erased(tmp_path):
    """SIGTERM mid-epoch: its two warnings are logged while the bar is open, then the run
    exits 75; both warnings are whole lines and the bar is not left on the screen."""
    code, shown = run_on_a_pty(tmp_path / "run", *MICRO, *TINY, fault="sigterm:2")
    assert code == 75, shown[-20:]
    assert_whole_lines_and_no_bar(tmp_path / "run", shown)
    assert any("SIGTERM received" in line for line in shown)


@pytest.mark.slow
def test_in_a_pipe_the_log_has_whole_lines_and_no_bar(tmp_path):
    """trainer.progress=true in a pipe: no bar, no redraw, the log's lines as they are.
    Fast sibling: test_off_a_terminal_the_bar_writes_nothing_and_reads_no_loss."""
    proc = train(tmp_path / "run", *TINY, "trainer.progress=true")
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "\r" not in out and "\x1b[" not in out and not BAR_FRAME.search(out)
    logged = (tmp_path / "run" / "train.log").read_text().splitlines()
    assert logged and all(line in proc.stdout.splitlines() for line in logged if line.strip())


@pytest.mark.parametrize("kind", ["device", "loader"])
@pytest.mark.parametrize("limit", [0, 2])
def test_an_evaluation_bars_total_is_the_batches_the_split_yields(kind, limit):
    from reprotrain.data.base import InMemoryTensors
    from reprotrain.data.pipeline import PipelineSpec, build_pipeline
    from reprotrain.repro.seeding import Seeds

    class Tensors(InMemoryTensors):
        def load_samples(self):
            return (torch.arange(40.0), torch.zeros(40)), (torch.arange(27.0), torch.zeros(27))

    data = Tensors()
    seeds = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")
    spec = PipelineSpec(10, 8, torch.device("cpu"), seeds, limit_eval_batches=limit)
    pipeline = build_pipeline(kind, data.splits(), data, 0, spec)
    splits = [s for s in ("val", "test") if pipeline.has_split(s)]
    assert "test" in splits
    for split in splits:
        assert pipeline.eval_steps(split) == len(list(pipeline.eval_batches(split))), split
