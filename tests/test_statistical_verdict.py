"""The statistical verdict: TOST with a stated margin, conclusions, sweep archives."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import MICRO, REPO, assert_ok, base_env
from reprotrain.tools.sweeps import compare_sweeps
from reprotrain.tools.sweeps.equivalence import (
    CONSISTENT,
    INCONCLUSIVE,
    INCONSISTENT,
    default_margin,
    mean_ci,
    t_quantile,
    tost,
)
from reprotrain.tools.sweeps.sweep_summary import describe

# --------------------------------------------------------------------------- the statistics


def test_quantiles_and_intervals_are_scipys_t():
    from scipy.stats import t

    assert t_quantile(0.975, 4) == pytest.approx(t.ppf(0.975, 4))
    lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert (lo + hi) / 2 == pytest.approx(2.0)
    assert (hi - lo) / 2 == pytest.approx(t.ppf(0.975, 2) * 1.0 / 3**0.5)
    assert describe([1.0, 2.0, 3.0])["ci95"] == pytest.approx([lo, hi])  # the summary's CI


def test_tost_verdicts_and_their_numbers():
    ref = [0.80, 0.82, 0.81, 0.79]
    same = tost(ref, [0.805, 0.815, 0.81, 0.795], margin=0.02)
    assert same.verdict == CONSISTENT and same.difference.n_candidate == 4
    worse = tost(ref, [0.60, 0.61, 0.62, 0.59], margin=0.02)
    assert worse.verdict == INCONSISTENT and worse.difference.diff == pytest.approx(-0.2)
    assert worse.difference.ci[1] < -0.02
    assert tost(ref, [0.81], margin=0.02).verdict == INCONCLUSIVE  # one seed
    noisy = tost(ref, [0.5, 0.9, 0.7, 0.95], margin=0.02)
    assert noisy.verdict == INCONCLUSIVE
    # a bitwise re-run of the same seeds: the paired interval is the point 0
    assert tost(ref, list(ref), margin=1e-9, pair=True).difference.ci == (0.0, 0.0)


def test_the_default_margin_is_the_references_ci_half_width_with_a_floor():
    ref = [0.80, 0.82, 0.81]
    m, how = default_margin(ref)
    lo, hi = mean_ci(ref)
    assert m == pytest.approx((hi - lo) / 2) and "95% CI half-width" in how
    m1, how1 = default_margin([0.8, 0.8, 0.8])
    assert m1 == pytest.approx(0.004) and "floor" in how1


# --------------------------------------------------------------------------- make compare


def fake_sweep(root: Path, groups: dict[str, list[float]], metric: str = "val_acc") -> Path:
    """A sweep dir as `make sweep` leaves it, with the final metric per seed given."""
    n = 0
    for override, values in groups.items():
        for seed, value in enumerate(values):
            job = root / str(n)
            (job / ".hydra").mkdir(parents=True)
            overrides = [f"seed.base={seed}", *([override] if override else [])]
            (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
            (job / "config.resolved.yaml").write_text(
                yaml.safe_dump({"trainer": {"monitor": metric, "monitor_mode": "max"}})
            )
            record = {"status": "completed", "seeds": {"base": seed},
                      "final_metrics": {metric: value, "train_loss": 1 - value}}  # fmt: skip
            (job / "run.json").write_text(json.dumps(record))
            n += 1
    return root


def compare(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reprotrain.tools.sweeps.compare_sweeps", str(a), str(b), *extra]
    return subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True)


def test_compare_gives_the_three_verdicts_with_their_numbers(tmp_path):
    a = fake_sweep(tmp_path / "a", {"": [0.80, 0.82, 0.81]})
    same = fake_sweep(tmp_path / "same", {"": [0.805, 0.815, 0.81]})
    worse = fake_sweep(tmp_path / "worse", {"optimizer.lr=0.01": [0.60, 0.62, 0.61]})
    one = fake_sweep(tmp_path / "one", {"": [0.81]})
    ok = compare(a, same)
    assert ok.returncode == 0 and "CONSISTENT" in ok.stdout, ok.stdout + ok.stderr
    assert "margin ±" in ok.stdout and "95% CI half-width" in ok.stdout and "(n=3)" in ok.stdout
    bad = compare(a, worse)
    assert bad.returncode == 1 and "INCONSISTENT" in bad.stdout, bad.stdout
    assert "A: (its defaults) vs B: optimizer.lr=0.01" in bad.stdout
    few = compare(a, one)
    assert few.returncode == 3 and "too few seeds" in few.stdout, few.stdout
    # MARGIN= is honoured and printed: a margin below the noise turns CONSISTENT undecided
    tight = compare(a, same, "--margin", "0.0001")
    assert tight.returncode == 3 and "(MARGIN=)" in tight.stdout
    report = json.loads((same / "comparison.json").read_text())
    assert report["groups"][0]["margin"] == 0.0001 and report["verdict"] == INCONCLUSIVE


def test_an_lr_by_seed_sweeps_conclusion_is_checked(tmp_path):
    lrs = {"optimizer.lr=0.1": [0.85, 0.86, 0.84], "optimizer.lr=0.2": [0.80, 0.81, 0.79]}
    a = fake_sweep(tmp_path / "a", lrs)
    holds = fake_sweep(tmp_path / "b", {"optimizer.lr=0.1": [0.851, 0.859, 0.842],
                                        "optimizer.lr=0.2": [0.801, 0.809, 0.792]})  # fmt: skip
    proc = compare(a, holds)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "optimizer.lr=0.1 better than optimizer.lr=0.2 by 5 pts (archived)" in proc.stdout
    assert "conclusion holds" in proc.stdout
    flipped = fake_sweep(tmp_path / "c", {"optimizer.lr=0.1": [0.80, 0.81, 0.79],
                                          "optimizer.lr=0.2": [0.85, 0.86, 0.84]})  # fmt: skip
    proc = compare(a, flipped)
    assert proc.returncode == 1 and "conclusion does NOT hold" in proc.stdout, proc.stdout


def test_compare_refuses_what_is_not_a_sweep_in_one_line(tmp_path):
    proc = compare(tmp_path / "nope", tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error:")
    a = fake_sweep(tmp_path / "a", {"": [0.8, 0.81]})
    proc = compare(a, a, "--metric", "test_f1")
    assert proc.returncode == 2 and "test_f1" in proc.stderr and "val_acc" in proc.stderr


def test_read_sweep_groups_by_non_seed_overrides(tmp_path):
    s = compare_sweeps.read_sweep(
        fake_sweep(tmp_path / "a", {"optimizer.lr=0.1": [0.1, 0.2], "optimizer.lr=0.2": [0.3]})
    )
    assert sorted(len(g.values) for g in s.groups.values()) == [1, 2]


# --------------------------------------------------------------------------- real sweeps (slow)

LEARNS = [*MICRO, "trainer.batch_size=32", "dataset.noise=8", "repro.num_threads=1"]


def sweep(sweep_dir: Path, *overrides: str) -> Path:
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", *LEARNS, *overrides,
           f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))
    return sweep_dir


@pytest.fixture(scope="module")
def lr_sweep(tmp_path_factory) -> Path:
    """lr 0.05 (learns) x lr 0.005 (ten times smaller: clearly worse) x 3 seeds."""
    root = tmp_path_factory.mktemp("lrsweep")
    return sweep(root / "sweep", "seed.base=0,1,2", "optimizer.lr=0.05,0.005")


def split_groups(sweep_dir: Path, dest: Path) -> dict[str, Path]:
    """Each lr's runs as a sweep of its own (what two separate `make sweep`s leave)."""
    out = {}
    for job in sorted(p for p in sweep_dir.iterdir() if (p / "run.json").is_file()):
        lr = next(o for o in yaml.safe_load((job / ".hydra/overrides.yaml").read_text())
                  if o.startswith("optimizer.lr="))  # fmt: skip
        out.setdefault(lr, dest / lr)
        shutil.copytree(job, dest / lr / job.name)
    return out


@pytest.mark.slow
def test_a_clearly_worse_setting_is_inconsistent(lr_sweep, tmp_path):
    parts = split_groups(lr_sweep, tmp_path)
    proc = compare(parts["optimizer.lr=0.05"], parts["optimizer.lr=0.005"], "--metric",
                   "train_loss")  # fmt: skip
    assert proc.returncode == 1 and "INCONSISTENT" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_sweep_archive_reproduced_statistically_is_consistent_and_keeps_its_conclusion(
    lr_sweep, tmp_path
):
    arch = [sys.executable, "-m", "reprotrain.tools.archive.archive", str(lr_sweep),
            "--out-dir", str(tmp_path / "archives")]  # fmt: skip
    proc = subprocess.run(arch, cwd=REPO, env=base_env(), capture_output=True, text=True)
    assert_ok(proc)
    assert "archived sweep sweep (6 runs)" in proc.stdout
    archive = next((tmp_path / "archives").glob("*.tar.gz"))
    cmd = [sys.executable, "-m", "reprotrain.tools.reproduce.reproduce", str(archive), "--trust",
           "--mode", "statistical", "--metric", "train_loss",
           "--runs-dir", str(tmp_path / "rerun")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("CONSISTENT")
    assert "optimizer.lr=0.05 better than optimizer.lr=0.005" in proc.stdout
    assert "conclusion holds" in proc.stdout


@pytest.mark.slow
def test_a_one_seed_sweep_is_inconclusive(lr_sweep, tmp_path):
    parts = split_groups(lr_sweep, tmp_path)
    one = tmp_path / "one"
    first = sorted(parts["optimizer.lr=0.05"].iterdir())[0]
    shutil.copytree(first, one / first.name)
    proc = compare(parts["optimizer.lr=0.05"], one)
    assert proc.returncode == 3 and "INCONCLUSIVE" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_a_tiny_sweep_archive_replays_every_seed_and_is_consistent(tmp_path):
    """Two seeds of a few steps, archived as a sweep, replayed statistically (slow tier:
    a sweep, its archive and a replay take ~20 s)."""
    tiny = [*MICRO, "trainer.epochs=1", "trainer.limit_train_steps=2", "seed.base=0,1"]
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", *tiny,
           f"hydra.sweep.dir={tmp_path / 's'}"]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))
    arch = [sys.executable, "-m", "reprotrain.tools.archive.archive", str(tmp_path / "s"),
            "--out-dir", str(tmp_path / "archives")]  # fmt: skip
    assert_ok(subprocess.run(arch, cwd=REPO, env=base_env(), capture_output=True, text=True))
    archive = next((tmp_path / "archives").glob("sweep-*.tar.gz"))
    cmd = [sys.executable, "-m", "reprotrain.tools.reproduce.reproduce", str(archive), "--trust",
           "--mode", "statistical", "--metric", "train_loss",
           "--runs-dir", str(tmp_path / "rerun")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CONSISTENT" in proc.stdout and "(n=2)" in proc.stdout and "margin ±" in proc.stdout
    report = json.loads(next((tmp_path / "rerun").glob("*/reproduction.json")).read_text())
    assert report["mode"] == "statistical" and report["exit_code"] == 0
    assert len(report["statistical"]["groups"]) == 1
