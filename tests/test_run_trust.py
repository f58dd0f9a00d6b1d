"""Nothing from an archive runs without trust: every command that builds from a run directory
(eval, bisect, report, compare, resume, ``train resume=<path>``) applies reproduce's trust
decision to a run that came from an archive (``tools/reproduce/run_trust.py``) before it
instantiates or imports anything. The extraction's marker and a real archive are in
test_archive.py; here the archive folders are built by hand, as ``tar -x`` leaves them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from reprotrain import commands
from reprotrain.errors import UntrustedArchive
from reprotrain.tools.archive.archive_check import MARKER
from reprotrain.tools.reproduce import config_trust, run_trust


def _run(folder: Path, model: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"status": "completed"}))
    (folder / "config.resolved.yaml").write_text(yaml.safe_dump({"model": model}))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "step-3.pt").write_bytes(b"not a checkpoint")
    return folder


def hostile_model(canary: Path) -> dict:
    """A model ``_target_`` that runs a command (the package's own command runner)."""
    return {"_target_": "reprotrain.tools.runs.resume.run_forwarding_signals",
            "cmd": ["touch", str(canary)], "env": {}}  # fmt: skip


def unpacked_archive(root: Path, model: dict, marked: bool = True) -> Path:
    """An archive's top folder as extraction leaves it, with one run; the run dir."""
    top = root / "top"
    run = _run(top / "run", model)
    (top / "MANIFEST.sha256").write_text("")
    (top / "archive.json").write_text("{}")
    if marked:
        (run / MARKER).write_text("{}")
    return run


def refused(argv: list[str], capsys) -> str:
    code = commands.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "came from an archive" in errors[0] and "TRUST=1" in errors[0]
    return errors[0]


@pytest.mark.parametrize("command", ["eval", "report", "resume", "bisect", "compare", "train"])
def test_a_hostile_run_from_an_archive_is_refused_before_anything_runs(command, tmp_path, capsys):
    canary = tmp_path / "CANARY"
    run = unpacked_archive(tmp_path / "d", hostile_model(canary))
    argv = {
        "eval": ["eval", str(run)],
        "report": ["report", str(run)],
        "resume": ["resume", str(run)],
        "bisect": ["bisect", str(run), str(run.parent.parent)],
        "compare": ["compare", str(run.parent), str(run.parent)],
        "train": ["train", "experiment=selfcheck", f"resume={run / 'checkpoints' / 'step-3.pt'}"],
    }[command]
    line = refused(argv, capsys)
    assert "reprotrain.tools.runs.resume.run_forwarding_signals" in line
    assert not canary.exists()


def test_the_resume_tools_own_entry_decides_too(tmp_path, capsys):
    """``python -m reprotrain.tools.runs.resume`` (not only ``reprotrain resume``) refuses a
    hostile run from an archive before composing its config."""
    from reprotrain.tools.runs import resume

    canary = tmp_path / "CANARY"
    run = unpacked_archive(tmp_path / "d", hostile_model(canary))
    assert resume.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert "came from an archive" in err and "Traceback" not in err and not canary.exists()


def test_a_run_moved_out_of_its_archive_keeps_the_marker(tmp_path, capsys):
    canary = tmp_path / "CANARY"
    run = unpacked_archive(tmp_path / "d", hostile_model(canary))
    moved = run.rename(tmp_path / "moved")
    refused(["eval", str(moved)], capsys)
    assert run_trust.archive_folder(moved) == moved.resolve()


def test_an_unmarked_folder_unpacked_by_hand_is_from_an_archive(tmp_path):
    run = unpacked_archive(tmp_path / "d", hostile_model(tmp_path / "C"), marked=False)
    assert run_trust.archive_folder(run / "checkpoints" / "step-3.pt") == run.parent.resolve()
    with pytest.raises(UntrustedArchive, match="starts a process or runs a command"):
        run_trust.decide(run)


def test_a_run_of_this_machine_needs_no_decision(tmp_path):
    run = _run(tmp_path / "own", hostile_model(tmp_path / "C"))
    assert run_trust.decide(run).rule == "own"


def test_rule_a_this_checkouts_callables_and_rule_c_trust(tmp_path):
    targets = config_trust.conf_targets(*config_trust.trusted_conf_dirs(REPO))
    ours = {"_target_": sorted(targets["model"])[0]}
    run = unpacked_archive(tmp_path / "a", ours)
    assert run_trust.decide(run).line().startswith("(a) 1 run config(s) and 0 sweep record(s)")
    hostile = unpacked_archive(tmp_path / "c", hostile_model(tmp_path / "C"))
    line = run_trust.decide(hostile, trust=True).line()
    assert line.startswith("(c) TRUST=1") and "(a) no:" in line
    interpolated = unpacked_archive(tmp_path / "i", {**ours, "width": "${oc.env:HOME}"})
    with pytest.raises(UntrustedArchive, match="is an interpolation"):
        run_trust.decide(interpolated)


def test_rule_b_needs_a_signature_that_verifies(tmp_path):
    run = unpacked_archive(tmp_path / "b", hostile_model(tmp_path / "C"))
    signers = tmp_path / "allowed_signers"
    signers.write_text("")
    with pytest.raises(UntrustedArchive, match=r"\(b\) no: .* is not signed"):
        run_trust.decide(run, trusted_signers=signers)


def test_trust_flags_are_read_for_the_gated_commands():
    trust, signers, rest = run_trust.pop_arguments(["r", "--trust", "--trusted-signers=f", "x"])
    assert trust and signers == Path("f") and rest == ["r", "x"]


def test_eval_prints_metric_names_escaped(monkeypatch, tmp_path, capsys):
    from reprotrain.tools.runs import eval as evaluation

    result = {"metrics": {"test_\x1b[31macc\u202e": 0.5}, "checkpoint": "c.pt", "global_step": 1}
    monkeypatch.setattr(evaluation, "evaluate_run", lambda *a: result)
    assert evaluation.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert "test_\\x1b[31macc" in out


def test_eval_takes_overrides_after_its_options(monkeypatch, tmp_path, capsys):
    """``make eval RUN=r ARGS=a=b`` runs ``eval r --checkpoint last a=b``: the override was
    an "unrecognized argument" after --checkpoint."""
    from reprotrain.tools.runs import eval as evaluation

    seen = {}

    def fake(run_dir, which, overrides):
        seen.update(which=which, overrides=overrides)
        return {"metrics": {}, "checkpoint": "c.pt", "global_step": 1}

    monkeypatch.setattr(evaluation, "evaluate_run", fake)
    argv = [str(tmp_path), "--checkpoint", "last", "trainer.eval_batch_size=8"]
    assert evaluation.main(argv) == 0
    assert seen == {"which": "last", "overrides": ["trainer.eval_batch_size=8"]}
