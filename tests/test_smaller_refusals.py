"""Bad input gets one line before anything is written: the smaller cases of issue 37 (tags
that are not text, a completion shell that does not exist, a portable refusal with a
newline in the value, a summary of a run directory, NPROC_B without invariance, a group
choice on resume). A killed archiver's staging dir and a full disk while archiving are in
test_trust.py (they use its archive)."""

from __future__ import annotations

import json

import pytest

from reprotrain import commands, preflight
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError
from reprotrain.repro import hashseed
from reprotrain.tools.runs import resume, verify
from reprotrain.tools.sweeps import sweep_summary


def test_tags_that_are_not_text_are_refused_in_preflight():
    register_configs()
    preflight.register_resolvers()
    with pytest.raises(ReprotrainError, match=r"tags: the item \{'b': 'c'\} is not text"):
        preflight.compose_all(["experiment=selfcheck", "tags=[a,{b:c},[d]]"])
    assert preflight.compose_all(["experiment=selfcheck", "tags=[a,'b:c']"])


def test_completion_for_a_shell_without_it_is_one_line(capsys):
    assert commands.main(["-sc", "install=fish"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: -sc install=fish") and err.count("\n") == 1


def test_a_newline_in_a_cpu_dispatch_variable_keeps_the_refusal_one_line():
    problem = hashseed.portable_problem(env={"ATEN_CPU_CAPABILITY": "avx2\n"}, machine="x86_64",
                                        cpu_flags={"avx2"})  # fmt: skip
    assert problem is not None and "\n" not in problem and "'avx2\\n'" in problem


def test_summary_of_a_run_directory_writes_nothing_into_it(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed"}))
    assert sweep_summary.main([str(tmp_path)]) == 2
    assert "is a run directory, not a sweep" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_verify_nproc_b_without_invariance_is_refused_before_run_a(tmp_path, capsys):
    out = tmp_path / "verify"
    assert verify.main(["--out-dir", str(out), "--nproc-b", "2", "experiment=selfcheck"]) == 2
    assert "not world-size-invariant" in capsys.readouterr().err
    assert not out.exists(), "run a never started"


def test_resume_with_a_group_choice_is_one_line(tmp_path, capsys):
    assert resume.main([str(tmp_path), "repro=strict"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "cannot choose another repro group" in line and "repro.<key>=" in line
