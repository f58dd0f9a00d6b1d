"""Progress of long operations: plain lines off a terminal (a log, CI, a pipe), a tqdm bar
on one; the download in bytes, a sweep's runs done, archive and reproduce phases."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from reprotrain.data import download as dl
from reprotrain.errors import DataMissingError
from reprotrain.progress import MIB, Phases, Progress
from reprotrain.tools.archive.pack import PHASES as ARCHIVE_PHASES
from reprotrain.tools.reproduce.rerun import PHASES as REPRODUCE_PHASES
from reprotrain.tools.sweeps import sweep_progress
from reprotrain.tools.sweeps.optuna_study import StudyView


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_progress_is_a_line_per_tenth_and_never_a_bar():
    out = io.StringIO()
    with Progress("download x.tar.gz", 3 * MIB, in_bytes=True, stream=out) as p:
        for _ in range(3):
            p.update(MIB)
    assert out.getvalue().splitlines() == [
        "download x.tar.gz: 1.0/3.0 MiB (33%)",
        "download x.tar.gz: 2.0/3.0 MiB (67%)",
        "download x.tar.gz: 3.0/3.0 MiB (100%)",
    ]
    assert "\r" not in out.getvalue()


def test_many_small_updates_give_a_line_per_tenth():
    out = io.StringIO()
    with Progress("sweep", 1000, unit="runs", stream=out) as p:
        for _ in range(1000):
            p.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1] == "sweep: 1000/1000 runs (100%)"


def test_an_unknown_total_says_how_much_at_the_end_and_a_stopped_one_where_it_stopped():
    out = io.StringIO()
    with Progress("download y", None, in_bytes=True, stream=out) as p:
        p.update(5 * MIB)
    assert out.getvalue().splitlines() == ["download y: 5.0 MiB"]
    out = io.StringIO()
    with Progress("download z", 10 * MIB, in_bytes=True, stream=out) as p:
        p.update(MIB // 2)  # below a tenth: no line yet; then it stops
    assert out.getvalue().splitlines() == ["download z: 0.5/10.0 MiB (5%)"]


def test_on_a_terminal_progress_is_a_tqdm_bar_not_lines():
    term = Terminal()
    with Progress("download x.tar.gz", 3 * MIB, in_bytes=True, stream=term) as p:
        p.update(3 * MIB)
    text = term.getvalue()
    assert "\r" in text and "download x.tar.gz" in text and "(100%)" not in text


def test_a_log_record_during_a_bar_is_a_whole_line_and_the_bar_leaves_nothing(monkeypatch):
    """A retry warning logged mid-download on the terminal the bar draws on: a whole line
    above the bar (tqdm's logging redirect), and the closed bar's frame erased."""
    from terminal import screen

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    handler = logging.StreamHandler(sys.stderr)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    with Progress("download x.tar.gz", 3 * MIB, in_bytes=True, stream=term) as p:
        p.update(MIB)
        logging.getLogger("reprotrain.data").warning("connection reset, retrying")
        p.update(2 * MIB)
    assert root.handlers == [handler]  # given back when the bar closed
    assert [line for line in screen(term.getvalue()) if line] == ["connection reset, retrying"]


def test_the_download_logs_its_bytes_as_it_goes(tmp_path: Path, caplog):
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(2 * MIB + MIB // 2))
    md5 = hashlib.md5(src.read_bytes()).hexdigest()

    def not_found(why: str) -> DataMissingError:
        return DataMissingError(why)

    with caplog.at_level(logging.INFO, logger=dl.__name__):
        dl.download(src.as_uri(), tmp_path / "data" / "blob.bin", md5, 5.0, not_found)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("download ")]
    assert lines == [
        "download blob.bin: 1.0/2.5 MiB (40%)",
        "download blob.bin: 2.0/2.5 MiB (80%)",
        "download blob.bin: 2.5/2.5 MiB (100%)",
    ]


# ----------------------------------------------------------------------------------- sweeps


def fake_sweep(root: Path, task: list[str], statuses: list[str]) -> Path:
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": task}}}))
    for i, status in enumerate(statuses):
        (root / str(i)).mkdir()
        (root / str(i) / "run.json").write_text(json.dumps({"status": status}))
    return root


def job_config(sweep_dir: Path, mode: str = "MULTIRUN", **sweeper) -> StudyView:
    """What the sweep callback's ``on_job_end`` takes of a job's config."""
    hydra = {"mode": mode, "sweep": {"dir": str(sweep_dir)}, "sweeper": sweeper}
    return StudyView.of(OmegaConf.create({"hydra": hydra}).hydra)


def test_a_sweep_says_runs_done_of_the_product_of_its_value_lists(tmp_path):
    sweep = fake_sweep(
        tmp_path / "s", ["seed.base=0,1,2", "optimizer.lr=0.1,0.2", "experiment=smoke"],
        ["completed", "failed", "running"],
    )  # fmt: skip
    said: list[str] = []
    sweep_progress.job_done(job_config(sweep, max_batch_size=None), emit=said.append)
    assert said == [f"sweep {sweep}: 2/6 runs done (33%)"]


def test_an_optuna_sweeps_total_is_its_trials_and_a_single_run_says_nothing(tmp_path):
    sweep = fake_sweep(tmp_path / "s", ["experiment=smoke"], ["completed"])
    said: list[str] = []
    sweep_progress.job_done(job_config(sweep, n_trials=3), emit=said.append)
    assert said == [f"sweep {sweep}: 1/3 runs done (33%)"]
    sweep_progress.job_done(job_config(sweep, mode="RUN"), emit=said.append)
    assert len(said) == 1


# ---------------------------------------------------------------------- archive, reproduce


def test_phases_are_numbered_lines_in_their_order():
    said: list[str] = []
    phases = Phases("reproduce", ["verify", "re-run"], emit=said.append)
    phases("verify"), phases("re-run")
    assert said == ["reproduce [1/2] verify", "reproduce [2/2] re-run"]
    assert REPRODUCE_PHASES.names[0] == "verify the archive" and "re-run" in REPRODUCE_PHASES.names
    assert ARCHIVE_PHASES.names[-1] == "seal and pack"


def test_a_replay_says_its_phase_on_stdout_and_a_refusal_stays_one_error_line(tmp_path, capsys):
    from reprotrain.tools.reproduce import reproduce

    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"not a tar archive")
    assert reproduce.main([str(bad), "--runs-dir", str(tmp_path / "runs")]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines() == ["reproduce [1/5] verify the archive"]
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
