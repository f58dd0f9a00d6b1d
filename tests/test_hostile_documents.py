"""A hostile record is one line before any trust decision, and what a record names is escaped
in the files a tool writes as on the terminal (``run/bounded.py``, ``shown.py``)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import REPO
from reprotrain.errors import RecordError
from reprotrain.run import bounded, report
from reprotrain.run.readers import parse_json_object, parse_jsonl, parse_yaml_config, read_overrides
from test_archive_limits import refused
from test_bad_inputs import archive, members
from test_report import fake_run


def alias_bomb(levels: int) -> str:
    """Billion laughs: each level is nine aliases of the one before."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "\n".join(lines) + "\n"


DEEP = 200_000
HOSTILE_YAML = {
    # About 74,000 nodes expanded (9**4 lists of 9): past the bound, yet small enough that
    # the code before the bound expanded it (slowly) instead of hanging this test.
    "alias bomb": (alias_bomb(4), "alias bomb"),
    "recursive alias": ("a: &a [x, *a]\n", "recursive alias"),
    "deep nesting": ("a: " + "[" * DEEP + "]" * DEEP + "\n", "nested more than 100"),
    "100k-digit integer": ("seed: " + "9" * 100_000 + "\n", "integer of 100000 digits"),
    "tagged integer": ('seed: !!int "' + "9" * 100_000 + '"\n', "integer of 100000 digits"),
    "base-60 integer": ("seed: 1" + ":59" * 40_000 + "\n", "integer of 120001 digits"),
}
HOSTILE_JSON = {
    "deep nesting": ('{"a": ' + "[" * DEEP + "]" * DEEP + "}", "nested more than 100"),
    "100k-digit integer": ('{"seed": ' + "9" * 100_000 + "}", "integer of 100000 digits"),
}


def refused_in_one_line(parse, text: str, label: str, why: str, named: str = "") -> None:
    """``parse(text, label)`` raises one RecordError line that starts with ``named`` (the
    label, or the label and line) and says ``why``."""
    with pytest.raises(RecordError) as e:
        parse(text, label)
    line = str(e.value)
    assert "\n" not in line and line.startswith(named or label) and why in line, line


@pytest.mark.parametrize("kind", HOSTILE_YAML)
def test_a_hostile_config_is_one_record_error(kind):
    text, why = HOSTILE_YAML[kind]
    refused_in_one_line(parse_yaml_config, text, "config.resolved.yaml", why)


@pytest.mark.parametrize("kind", HOSTILE_JSON)
def test_hostile_json_in_run_json_or_a_jsonl_row_is_one_record_error(kind):
    text, why = HOSTILE_JSON[kind]
    refused_in_one_line(parse_json_object, text, "run.json", why)
    rows = '{"epoch": 1}\n' + text + "\n"
    refused_in_one_line(parse_jsonl, rows, "metrics.jsonl", why, "metrics.jsonl line 2")


def test_the_billion_laughs_is_refused_from_its_graph_at_once():
    start = time.perf_counter()
    with pytest.raises(RecordError, match="alias bomb"):
        parse_yaml_config(alias_bomb(9), "config.resolved.yaml")  # 9**10 nodes expanded
    assert time.perf_counter() - start < 5, "composed, not expanded"


def test_aliases_within_bounds_and_plain_records_still_read():
    cfg = parse_yaml_config("base: &b {lr: 0.1}\nopt: *b\nseed: 18446744073709551615\n", "c")
    assert cfg.opt.lr == 0.1 and cfg.seed == 2**64 - 1
    assert parse_json_object('{"a": [[1, 2]], "s": 18446744073709551615}', "r")["a"] == [[1, 2]]
    assert bounded.load_json("NaN", "x") != bounded.load_json("NaN", "x")  # lenient on NaN


def test_hostile_overrides_yaml_is_one_record_error(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(alias_bomb(4))
    with pytest.raises(RecordError, match="alias bomb"):
        read_overrides(tmp_path)


@pytest.mark.parametrize("kind", ["alias bomb", "recursive alias", "100k-digit integer"])
def test_reproduce_refuses_a_hostile_archived_config_in_one_line(kind, tmp_path, capsys):
    archive(members(**{"run/config.resolved.yaml": HOSTILE_YAML[kind][0]}))(tmp_path)
    line = refused(tmp_path / "a.tar.gz", tmp_path, capsys)
    assert HOSTILE_YAML[kind][1] in line and "config.resolved.yaml" in line, line


@pytest.mark.parametrize("kind", HOSTILE_JSON)
@pytest.mark.parametrize("rel", ["run/run.json", "run/metrics.jsonl", "run/fingerprints.jsonl"])
def test_reproduce_refuses_hostile_json_in_an_archived_record_in_one_line(
    rel, kind, tmp_path, capsys
):
    text, why = HOSTILE_JSON[kind]
    archive(members(**{rel: text + "\n"}))(tmp_path)
    line = refused(tmp_path / "a.tar.gz", tmp_path, capsys)
    assert why in line and rel.split("/")[1] in line, line


def test_report_of_a_deep_run_json_is_one_line_and_exit_2(tmp_path, capsys):
    run = fake_run(tmp_path / "run")
    (run / "run.json").write_text(HOSTILE_JSON["deep nesting"][0])
    assert report.main([str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "nested more than 100" in err[0], err


HOSTILE_NAME = "val_\x1b[31mred\u202eevil\u200b\x07\r"


def run_with_hostile_metric(run_dir: Path) -> Path:
    """A fake run whose every epoch row and final metrics log HOSTILE_NAME."""
    run = fake_run(run_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, HOSTILE_NAME: 0.5}) + "\n" for r in rows)
    )
    record = json.loads((run / "run.json").read_text())
    record["final_metrics"] = {**rows[-1], HOSTILE_NAME: 0.5}
    (run / "run.json").write_text(json.dumps(record))
    return run


def assert_escaped(written: str, out) -> None:
    """No raw control or invisible character in the file or on the terminal, and
    matplotlib's own warning about the name's glyphs shown escaped, not swallowed."""
    for raw in ("\x1b", "\u202e", "\u200b", "\x07", "\r"):
        assert raw not in written and raw not in out.err and raw not in out.out, repr(raw)
    assert "\\x1b[31mred\\u202eevil\\u200b\\x07\\r" in written
    warned = [x for x in out.err.splitlines() if x.startswith("warning: ")]
    assert warned and any("\\x1b" in x for x in warned), out.err


def test_report_md_and_the_terminal_show_a_metric_name_escaped(tmp_path, capsys):
    run = run_with_hostile_metric(tmp_path / "run")
    assert report.main([str(run)]) == 0
    assert_escaped((run / "report.md").read_text(), capsys.readouterr())


def test_summary_md_and_the_terminal_show_a_metric_name_escaped(tmp_path, capsys):
    from reprotrain.tools.sweeps import sweep_summary

    for job in ("0", "1"):
        run_with_hostile_metric(tmp_path / "sweep" / job)
    assert sweep_summary.main([str(tmp_path / "sweep")]) == 0
    assert_escaped((tmp_path / "sweep" / "summary.md").read_text(), capsys.readouterr())


def test_warnings_shown_prints_each_third_party_warning_once_escaped(capsys):
    import warnings

    from reprotrain.shown import warnings_shown

    with warnings_shown():
        for _ in range(3):
            warnings.warn("Glyph 27 (\x1b) missing\r\x07", UserWarning, stacklevel=1)
    err = capsys.readouterr().err
    assert err == "warning: UserWarning: Glyph 27 (\\x1b) missing\\r\\x07\n", repr(err)


# ------------------------------------------- sweep and study files: one bounded reader


def sweep_dir_holding(root: Path, record: str, extracted: bool) -> Path:
    """A sweep dir whose multirun.yaml is ``record`` (an extracted archive's, or local)."""
    from reprotrain.tools.archive.archive_check import MARKER

    sweep = root / "top" / "sweep"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(record)
    if extracted:
        for name in ("MANIFEST.sha256", MARKER):
            (root / "top" / name).write_text("")
        (root / "top" / "archive.json").write_text("{}")
    return sweep


@pytest.mark.parametrize("extracted", [False, True], ids=["local", "extracted"])
@pytest.mark.parametrize("kind", ["alias bomb", "recursive alias"])
def test_resume_of_a_sweep_with_a_hostile_multirun_yaml_is_one_line(
    kind, extracted, tmp_path, capsys
):
    """5bba2ff: the alias bomb spun at full CPU; the recursive alias said "not a reprotrain
    run directory". Now both are refused, for what they are, at once."""
    from reprotrain import commands

    text = alias_bomb(6) if kind == "alias bomb" else "hydra: &a {overrides: [x, *a]}\n"
    sweep = sweep_dir_holding(tmp_path, text, extracted)
    began = time.monotonic()
    assert commands.main(["resume", str(sweep)]) == 2
    assert time.monotonic() - began < 30  # 5bba2ff: minutes at full CPU, until killed
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "multirun.yaml" in errors[0] and HOSTILE_YAML[kind][1] in errors[0], errors[0]


def study_with_a_journal(sweep: Path) -> Path:
    """A finished one-trial study as the sweeper leaves it: a completed job, study.json,
    multirun.yaml and the journal Optuna wrote (no training)."""
    import optuna

    from reprotrain.sweep_checks import OPTUNA_SWEEPER
    from reprotrain.tools.sweeps import optuna_study

    fake_run(sweep / "0", epochs=2)
    (sweep / "0" / ".hydra").mkdir()
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.1\n")
    task = ["+hparams_search=smoke_optuna"]
    record = {"hydra": {"sweeper": {"_target_": OPTUNA_SWEEPER},
                        "overrides": {"hydra": [], "task": task}}}  # fmt: skip
    (sweep / "multirun.yaml").write_text(json.dumps(record))
    journal = sweep / optuna_study.JOURNAL
    study = optuna.create_study(study_name="s", storage=optuna_study.open_journal(journal))
    settings = {"metric": "val_acc", "metric_mode": "max", "study_name": "s",
                "search_space": {"optimizer.lr": "x"}, "storage": None, "optuna_storage":
                optuna_study.JOURNAL, "sampler": {"seed": 0}}  # fmt: skip
    value = optuna_study.trial_value(sweep / "0", "val_acc", "max")
    lr = optuna.distributions.FloatDistribution(0.01, 1)
    made = optuna.trial.create_trial(params={"optimizer.lr": 0.1}, value=value,
                                     distributions={"optimizer.lr": lr})  # fmt: skip
    study.add_trial(made)
    assert optuna_study.write_study(sweep, settings)["storage_agrees"] is True
    return journal


def test_a_torn_journal_is_one_line_and_exit_2_and_the_summary_says_it_does_not_agree(
    tmp_path, capsys
):
    """5bba2ff: a 38-line UnicodeDecodeError traceback from resume, and ``summary`` kept
    ``storage_agrees: true`` from study.json."""
    from reprotrain import commands
    from reprotrain.tools.sweeps import sweep_summary

    sweep = tmp_path / "study"
    journal = study_with_a_journal(sweep)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1][:10] + b"\xe9\xff" + lines[1][12:]  # a torn write: not UTF-8
    journal.write_bytes(b"".join(lines))
    assert commands.main(["resume", str(sweep)]) == 2
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "study.journal line 2 is torn or damaged (not UTF-8)" in errors[0]
    assert sweep_summary.main([str(sweep)]) == 0
    assert json.loads((sweep / "summary.json").read_text())["storage_agrees"] is False
    assert "storage_agrees: false" in (sweep / "summary.md").read_text()


#: The parses of text outside the bounded reader (run/bounded.py, run/readers.py), each of
#: text no directory the user was handed can hold: {file: why}.
NOT_FROM_A_DIRECTORY = {
    "src/reprotrain/run/record.py": "strict_loads: the writer's own JSON, checked as written",
    "src/reprotrain/run/mutex.py": "the lock file this machine's run wrote (its pid, host)",
    "src/reprotrain/repro/rng.py": "numpy's own bit generator state, in this process",
    "src/reprotrain/repro/lock_platforms.py": "the package index's JSON answer",
    "src/reprotrain/repro/requirements_lock.py": "installed packages' metadata",
    "src/reprotrain/hashing.py": "this checkout's hash cache (build/)",
    "src/reprotrain/conf/__init__.py": "the framework's own packaged YAML",
    "src/reprotrain/tools/template/template_files.py": "the template's own file list",
    "src/reprotrain/tools/reproduce/reproduce_sweep.py": "a round trip of its own dict",
}
RAW_PARSE = re.compile(r"\b(json\.loads?|yaml\.(safe_)?load|OmegaConf\.load)\(")


def test_every_record_read_from_a_directory_goes_through_the_bounded_reader():
    """One bounded reader (issue: an alias bomb reached ``resume`` through a second one): a
    raw ``json.loads`` / ``yaml.safe_load`` / ``OmegaConf.load`` anywhere else in the package
    is a reader that skips the bounds, unless its text cannot come from a directory."""
    raw = {}
    for path in sorted((REPO / "src" / "reprotrain").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ("src/reprotrain/run/bounded.py", "src/reprotrain/run/readers.py"):
            continue
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                if RAW_PARSE.search(line)]  # fmt: skip
        if hits:
            raw[rel] = hits
    assert set(raw) <= set(NOT_FROM_A_DIRECTORY), {k: raw[k] for k in set(raw) - set(
        NOT_FROM_A_DIRECTORY)}  # fmt: skip
    assert set(NOT_FROM_A_DIRECTORY) <= set(raw), "a named exception no longer parses: drop it"
