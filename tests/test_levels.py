"""Each repro level is one value (src/reprotrain/repro/levels.py) that says what it refuses,
what it records and which controls it sets; every other module asks it. ``portable`` is
``strict`` plus pinned CPU dispatch, so what strict refuses, portable refuses too."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO
from reprotrain.data import purity
from reprotrain.errors import ReprotrainError, ResumeError
from reprotrain.repro import determinism, levels
from reprotrain.resume import guard

IMPURE = purity.PurityVerdict(checked=4, pure=False, reason="key (0, 0) differs between draws")


def refuses_an_impure_sample(name: str, monkeypatch) -> bool:
    monkeypatch.setattr(purity, "check_pipeline", lambda pipeline: IMPURE)
    try:
        purity.check_samples(None, name, {})
    except ReprotrainError:
        return True
    return False


def refuses_an_unrestorable_resume(name: str, tmp_path: Path) -> bool:
    point = guard.ResumePoint(tmp_path / "step-3.pt", {})
    current = {"repro": {"level": name}, "trainer": {}}
    try:
        guard.check_unrestored(point, ["task attribute `preds` (list)"], current, [])
    except ResumeError as e:
        assert f"under repro={name}:" in str(e) and "\n" not in str(e)
        return True
    return False


@pytest.mark.parametrize("name", list(levels.LEVELS))
def test_the_data_check_and_the_resume_guard_refuse_at_the_same_levels(name, monkeypatch, tmp_path):
    """The disagreement settled: an impure sample and a resume that cannot be bitwise are both
    refused at strict and portable, both recorded at warn and fast."""
    both = (
        refuses_an_impure_sample(name, monkeypatch),
        refuses_an_unrestorable_resume(name, tmp_path),
    )
    assert both == ((True, True) if name in ("strict", "portable") else (False, False)), name


def test_portable_is_strict_plus_pinned_cpu_dispatch():
    assert levels.PORTABLE.pins_cpu_dispatch and not levels.STRICT.pins_cpu_dispatch
    assert replace(levels.PORTABLE, name="strict", pins_cpu_dispatch=False) == levels.STRICT


def test_an_unknown_level_is_refused_in_one_line_naming_the_known_ones():
    with pytest.raises(ReprotrainError) as caught:
        determinism.apply("paranoid", 1)
    message = str(caught.value)
    assert "'paranoid'" in message and "strict, warn, fast, portable" in message
    assert "\n" not in message


def _compares_a_level_name(node: ast.Compare, source: str) -> bool:
    names = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
    return bool(names & set(levels.LEVELS)) and "level" in ast.get_source_segment(source, node)


def test_no_module_but_levels_compares_level_names():
    """``level == "strict"``, ``level in ("strict", "portable")``: each is a second definition
    of what a level means, the way two of them came to disagree."""
    found = []
    for path in sorted((REPO / "src" / "reprotrain").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Compare) and _compares_a_level_name(node, source):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found
