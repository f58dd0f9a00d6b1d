"""make bisect: the first divergent step from the records, then the first divergent op."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_ok, base_env, jsonl, train
from reprotrain.repro import checkpoint, op_trace
from reprotrain.tools.debugging.bisect import (
    bisect_command,
    nearest_checkpoint,
    state_differences,
    step_losses,
)
from reprotrain.tools.debugging.trace_diff import first_difference, first_digest_difference

# One short epoch: 8 steps of 64, a step checkpoint every 2 steps (the default tier's twins).
TINY = ["trainer.epochs=1", "trainer.limit_train_steps=8", "trainer.checkpoint_every_steps=2"]
# The slow tier's thread-count pair: 16 steps, every checkpoint kept. Where 1 and 2 threads
# first differ is a fact of the host (step 4 on a Zen 4, later than step 5 on a Zen 3), so
# the tests below derive every step they expect from the losses this host measured.
LONG = ["trainer.epochs=2", "trainer.checkpoint_every_steps=2", "trainer.keep_checkpoints=8"]


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict[str, Path]:
    """threads 1, twice: identical twins (the default tier's runs)."""
    root = tmp_path_factory.mktemp("bisect")
    for name in ("t1", "t1_again"):
        assert_ok(train(root / name, *TINY, "repro.num_threads=1"))
    return {name: root / name for name in ("t1", "t1_again")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """threads 1 and threads 2 over 16 steps (slow tier: two runs and traced replays)."""
    root = tmp_path_factory.mktemp("bisect-threads")
    for name, threads in (("t1", 1), ("t2", 2)):
        assert_ok(train(root / name, *LONG, f"repro.num_threads={threads}"))
    return {name: root / name for name in ("t1", "t2")}


def losses(run: Path) -> dict[int, float]:
    """{global step: loss} as the run recorded it."""
    return step_losses(jsonl(run / "fingerprints.jsonl"))


def first_thread_difference(a: Path, b: Path) -> int:
    """The first global step whose loss differs between 1 and 2 threads on this host."""
    la, lb = losses(a), losses(b)
    differ = [s for s in sorted(la) if la[s] != lb[s]]
    assert differ, (
        f"1 and 2 threads gave the same {len(la)} losses on this host: bisect's tests need "
        "a thread-count difference; lengthen LONG"
    )
    return differ[0]


def bisect(a: Path, b: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reprotrain.tools.debugging.bisect", str(a), str(b), *args]
    return subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True)


@pytest.mark.slow
def test_thread_counts_name_the_first_divergent_step_and_an_aten_op_in_a_module(runs):
    a, b = runs["t1"], runs["t2"]
    first = first_thread_difference(a, b)
    proc = bisect(a, b)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the configs differ in: repro.num_threads (1 vs 2)" in proc.stdout
    report = json.loads((b / "bisect.json").read_text())  # b started later
    assert report["divergence"]["global_step"] == first
    finding = report["finding"]
    assert finding["kind"] == "output" and finding["op"].startswith("aten.")
    assert finding["module"] not in ("", None)
    assert finding["inputs_identical"] is True, proc.stdout  # the op that made the difference
    assert finding["step"] <= first
    assert "inputs identical -> a nondeterministic kernel" in proc.stdout
    assert f"first difference in {finding['module']} ({finding['op']}" in proc.stdout
    assert all(r["losses_match_record"] for r in report["replays"])


def hide_first_differences(a: Path, b: Path, until: int) -> None:
    """Give run ``b`` the recorded losses of ``a`` before global step ``until``: what a loss
    that rounds to the same value while the weights already differ looks like in the
    records."""
    ra, rb = jsonl(a / "fingerprints.jsonl"), jsonl(b / "fingerprints.jsonl")
    for row_a, row_b in zip(ra, rb, strict=True):
        first = row_b["global_step"] - len(row_b["step_losses"])
        keep = max(0, min(len(row_b["step_losses"]), until - first))
        row_b["step_losses"][:keep] = row_a["step_losses"][:keep]
    (b / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rb))


@pytest.mark.slow
def test_a_difference_made_before_the_traced_step_is_walked_back_to_its_op(runs, tmp_path):
    """The records are made to point past a checkpoint whose state already differs (the
    losses before it are copied from A); the traced steps' first differing op then had
    differing inputs. Bisect walks back: the checkpoints after the op's step differ, the one
    at or before it (or the start) agrees, the per-step digests name the first step that
    differs, and its trace names an op whose inputs were identical. With too short a replay
    allowance it says why not, with the checkpoint cadence that would do."""
    a, b = runs["t1"], tmp_path / "t2"
    shutil.copytree(runs["t2"], b)
    ckpts = sorted(
        checkpoint.step_of(p) for p in checkpoint.list_step_checkpoints(a / "checkpoints")
    )
    first = first_thread_difference(a, b)
    # The state after step `first` differs: the records point one step past that checkpoint.
    after = [c for c in ckpts if c > first]
    assert after and after[0] + 1 <= max(losses(a)), f"no room past step {first}: lengthen LONG"
    hide_first_differences(a, b, after[0] + 1)
    la, lb = losses(a), losses(b)
    pointed = next(s for s in sorted(la) if la[s] != lb[s])

    short = bisect(a, b, "--max-replay-steps", "1")
    assert short.returncode == 1, short.stdout + short.stderr
    assert "walking back: no checkpoint early enough" in short.stdout
    steps = len(la)
    assert f"trainer.checkpoint_every_steps=1 trainer.keep_checkpoints={steps}" in short.stdout

    proc = bisect(a, b)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((b / "bisect.json").read_text())
    assert report["divergence"]["global_step"] == pointed
    walk, finding = report["walk_back"], report["finding"]
    k = walk["first_differing_step"]
    assert finding["step"] == k <= first
    differing = {int(c) for c in walk["differing_checkpoints"]}
    assert differing and min(differing) == min(c for c in ckpts if c > k)
    assert differing == {c for c in ckpts if k < c <= max(differing)}
    assert all("model" in parts for parts in walk["differing_checkpoints"].values())
    origin = max((c for c in ckpts if c <= k), default=0)
    assert walk["origin_global_step"] == origin
    assert walk["digested_steps"] == list(range(origin, min(differing)))
    assert finding["kind"] == "output" and finding["inputs_identical"] is True
    assert "inputs identical" in proc.stdout.split("RESULT")[1].split("walked back")[0]
    assert any(f"walked back from step {s}:" in proc.stdout for s in report["traced_steps"])


def test_digests_name_the_first_step_whose_batch_or_ops_differ():
    row = {"batch": ["x"], "ops": 3, "digest": "d"}
    a = {s: dict(row) for s in range(4)}
    assert first_digest_difference(range(4), a, a) == (None, [])
    b = {**a, 2: {**row, "digest": "e"}, 3: {**row, "batch": ["y"]}}
    assert first_digest_difference(range(4), a, b) == (2, [])
    assert first_digest_difference(range(4), a, {0: row}) == (None, [1, 2, 3])


def test_a_digest_is_the_same_for_the_same_ops_and_differs_for_another_reduction(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(op_trace.DIR_VAR, str(tmp_path))
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    for global_step, scale in ((0, 1.0), (1, 1.0), (2, 1.0 + 2**-20)):
        with op_trace.digest(global_step, (x,)):
            (x * scale).sum(0).relu()
    rows = op_trace.read_digests(tmp_path)
    assert rows[0]["digest"] == rows[1]["digest"] != rows[2]["digest"]
    assert rows[0]["ops"] == 3 and rows[0]["batch"] == rows[2]["batch"]


def test_checkpoint_state_differences_name_the_parts(tmp_path):
    from reprotrain.repro.checkpoint import FORMAT_VERSION

    base = {"format_version": FORMAT_VERSION, "config": {"x": 1}, "loop": {"step": 1},
            "model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "rng": [1, 2]}  # fmt: skip
    other = {**base, "config": {"x": 2}, "loop": {"step": 9}, "model": {"w": torch.ones(2)}}
    torch.save(base, tmp_path / "a.pt")
    torch.save(other, tmp_path / "b.pt")
    assert state_differences(tmp_path / "a.pt", tmp_path / "b.pt") == []
    nudged = torch.ones(2)
    nudged[1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    torch.save({**other, "model": {"w": nudged}, "rng": [1, 3]}, tmp_path / "c.pt")
    assert state_differences(tmp_path / "a.pt", tmp_path / "c.pt") == ["model", "rng"]


def test_identical_runs_exit_0(twins):
    proc = bisect(twins["t1"], twins["t1_again"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "IDENTICAL" in proc.stdout


def test_identical_bits_from_another_precision_say_the_configs_differ(twins, tmp_path):
    """A 32-true and a tf32 CPU run give the same bits (tf32 touches no CPU kernel here):
    IDENTICAL bits, exit 0, and the verdict names the precision, config and float math."""
    tf32 = tmp_path / "tf32"
    shutil.copytree(twins["t1_again"], tf32)
    config = tf32 / "config.resolved.yaml"
    config.write_text(config.read_text().replace("precision: 32-true", "precision: tf32"))
    record = json.loads((tf32 / "run.json").read_text())
    record["repro"] |= {"precision": "tf32", "tf32_matmul": True, "tf32_cudnn": True}
    (tf32 / "run.json").write_text(json.dumps(record))
    proc = bisect(twins["t1"], tf32)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "config   the configs differ in: trainer.precision ('32-true' vs 'tf32')" in proc.stdout
    verdict = json.loads((tf32 / "bisect.json").read_text())["verdict"]
    assert verdict.startswith("IDENTICAL bits from two configs: they differ in trainer.precision")
    assert "run.json repro.tf32_matmul" in verdict and f"RESULT   {verdict}" in proc.stdout


@pytest.mark.slow
def test_another_data_stream_is_the_batch_at_step_0(runs, tmp_path):
    assert_ok(train(tmp_path / "data7", *LONG, "repro.num_threads=1", "seed.data=7"))
    proc = bisect(runs["t1"], tmp_path / "data7")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "step 0: the batch differs -> data order (seed.data)" in proc.stdout
    assert "seed.data" in proc.stdout


def test_a_missing_run_is_one_line_and_exit_2(tmp_path):
    proc = bisect(tmp_path / "nope", tmp_path / "nada")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.splitlines()) == 1


def test_the_nearest_checkpoint_is_at_or_before_the_step(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for n in (2, 4, 6):
        (ckpts / f"step-{n:08d}.pt").write_bytes(b"")
    assert nearest_checkpoint(tmp_path, 5)[1] == 4
    assert nearest_checkpoint(tmp_path, 4)[1] == 4
    assert nearest_checkpoint(tmp_path, 1) == (None, 0)


def _trace(batch: str, *ops: tuple[str, list[int], list[int]]) -> list[dict]:
    rows = [{"op": "batch", "module": "-", "phase": "input", "inputs": [], "outputs": [batch],
             "index": -1}]  # fmt: skip
    for i, (op, ins, outs) in enumerate(ops):
        rows.append({"op": op, "module": f"m{i}", "phase": "forward", "inputs": ins,
                     "outputs": outs, "index": i})  # fmt: skip
    return rows


def test_trace_diff_names_kernel_outside_and_batch_causes():
    a = _trace("x", ("aten.mm", [1], [2]), ("aten.relu", [2], [3]))
    assert first_difference(0, a, a) is None
    kernel = first_difference(0, a, _trace("x", ("aten.mm", [1], [9]), ("aten.relu", [9], [3])))
    assert (kernel.module, kernel.inputs_identical) == ("m0", True)
    assert "inputs identical -> a nondeterministic kernel" in kernel.sentence()
    outside = first_difference(0, a, _trace("x", ("aten.mm", [7], [9]), ("aten.relu", [9], [3])))
    assert outside.inputs_identical is False and "inputs already differed" in outside.sentence()
    assert first_difference(0, a, _trace("y", *[])).kind == "batch"
    empty = _trace("x", ("aten.empty.memory_format", [], [5]), ("aten.mm", [1], [2]))
    noise = _trace("x", ("aten.empty.memory_format", [], [6]), ("aten.mm", [1], [2]))
    assert first_difference(0, empty, noise) is None  # uninitialised memory is not a difference


def test_verify_points_to_bisect_with_both_dirs():
    line = bisect_command(Path("/tmp/a b/a"), Path("/tmp/a b/b"))
    assert line == "make bisect 'A=/tmp/a b/a' 'B=/tmp/a b/b'"
