"""Every path a config names is confined (docs/guarantees.md, "Paths a config names").

The attack first: ``reproduce`` of an archive whose CSV file name is absolute or climbs out
with ``..`` replaced a file outside the run and still said REPRODUCED. Then the doors: every
path-like key of the schemas and of every shipped ``_target_`` YAML, found by enumeration,
each tried with an absolute path, ``..`` and a symlink that leads out.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, ListConfig

from conftest import REPO, TINY, assert_ok, base_env, train
from reprotrain import conf, config, preflight
from reprotrain.loggers import LoggerConfig
from reprotrain.run import paths


def tool(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"reprotrain.tools.{name}", *args], cwd=cwd,
                          env=base_env(), capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def csv_archive(tmp_path_factory) -> Path:
    """A tiny run with the CSV logger, archived."""
    base = tmp_path_factory.mktemp("csv")
    assert_ok(train(base / "run", *TINY, "logger=csv"))
    assert_ok(tool("archive.archive", str(base / "run"), "--out-dir", str(base), cwd=base))
    (archive,) = base.glob("*.tar.gz")
    return archive


def with_csv_filename(archive: Path, tmp: Path, filename: str) -> Path:
    """The archive with ``logger.csv.filename`` replaced (a non-identity key: the record's
    config_sha256 still holds) and its manifest regenerated, as its author would."""
    from test_archive import repack, unpack

    top = unpack(archive, tmp / "unpacked")
    config = top / "run" / "config.resolved.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["logger"]["csv"]["filename"] = filename
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return repack(top, tmp / "hostile.tar.gz")


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_reproduce_of_an_archive_whose_csv_file_leaves_the_run_writes_nothing_outside(
    csv_archive, tmp_path, how
):
    """Was: the victim file replaced by the CSV rows, and the verdict REPRODUCED."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    runs = tmp_path / "runs"
    # The re-run's directory is <runs>/<stamp>: four levels up from it is tmp_path.
    name = str(victim) if how == "absolute" else "../../victim.txt"
    hostile = with_csv_filename(csv_archive, tmp_path, name)
    proc = tool("reproduce.reproduce", str(hostile), "--trust", "--runs-dir", str(runs),
                cwd=tmp_path)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert victim.read_text() == "precious\n", out[-3000:]
    assert proc.returncode == 2 and "REPRODUCED" not in proc.stdout, out[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert errors and "logger.csv.filename=" in errors[0] and "Traceback" not in out, out[-3000:]
    assert not runs.exists() or not any(runs.iterdir()), "refused before Hydra made the run dir"


# ------------------------------------------------------------------ every path-like key

#: A key is path-like when its name says so and it holds text (a type filter drops the
#: ints and bools: ignore_index, log_every_steps, verify_resume).
PATHLIKE = re.compile(r"dir|path|file|root|folder|index|uri|name|resume|untracked|storage")
CONF_ROOTS = [REPO / "conf", REPO / "src/reprotrain/conf", REPO / "src/reprotrain/selfcheck/conf"]
#: Keys Hydra sets itself (never a user's value) and its help text.
HYDRA_OWN = ("hydra.runtime.", "hydra.help.", "hydra.hydra_help.", "hydra.overrides.",
             "hydra.job.override_dirname", "hydra.job.config_name", "hydra.job.id")  # fmt: skip


def _texty(hint: Any) -> bool:
    return (
        hint is Any
        or any(a in (str, Path) for a in (hint, *typing.get_args(hint)))
        or (typing.get_origin(hint) is list and typing.get_args(hint) == (str,))
    )


def schema_keys(cls: type = config.TrainConfig, prefix: str = "") -> dict[str, str]:
    """{key: where found} of every path-like field of the schemas, nested ones included."""
    found, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            found |= schema_keys(hint, f"{prefix}{f.name}.")
        elif PATHLIKE.search(f.name) and _texty(hint) and not isinstance(f.default, bool):
            found[f"{prefix}{f.name}"] = f"schema {cls.__name__}.{f.name}"
    return found


def _params(target: str, node: dict) -> dict[str, Any]:
    """A ``_target_`` node's keys, and its callable's named parameters (their defaults)."""
    from hydra._internal.utils import _locate

    params = {k: v for k, v in node.items() if not k.startswith("_")}
    try:
        signature = inspect.signature(_locate(target))
    except (ImportError, ValueError, TypeError):
        return params
    for name, p in signature.parameters.items():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self":
            hinted = p.annotation if p.annotation is not p.empty else None
            text = isinstance(p.default, str) or hinted in (str, "str", Path, "Path")
            params.setdefault(name, p.default if text else p.default is p.empty and None)
    return params


def target_keys() -> dict[str, tuple[str, list[str]]]:
    """{key: (YAML file, overrides that select it)} of every path-like parameter of every
    ``_target_`` node in the shipped YAMLs."""
    found = {}
    for root in CONF_ROOTS:
        for path in sorted(root.rglob("*.yaml")):
            text = path.read_text()
            rel = path.relative_to(root).with_suffix("")
            group = rel.parent.as_posix() if rel.parent != Path(".") else ""
            package = conf.package_header(text) or group.replace("/", ".")
            base = "" if package == "_global_" else package
            select = [f"{group}={rel.name}"] if group else []
            for key, node in _target_nodes(yaml.safe_load(text), base):
                for name, value in _params(str(node["_target_"]), node).items():
                    texty = value is None or isinstance(value, str)
                    if PATHLIKE.search(name) and texty and not isinstance(value, bool):
                        found.setdefault(f"{key}.{name}".lstrip("."), (str(path), select))
    return found


def _target_nodes(node: Any, key: str) -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        if "_target_" in node:
            yield key, node
        for k, v in node.items():
            yield from _target_nodes(v, f"{key}.{k}".lstrip("."))
    elif isinstance(node, list):
        for v in node:
            yield from _target_nodes(v, key)


def hydra_keys() -> dict[str, str]:
    """Every path-like key of the composed Hydra node a user can set (``hydra.run.dir`` ...)."""
    (cfg,) = [_composed_with_hydra(["experiment=selfcheck"])]
    found = {}
    for key, value in _leaves(cfg.hydra, "hydra"):
        leaf = key.rsplit(".", 1)[-1]
        own = key.startswith(HYDRA_OWN)
        if PATHLIKE.search(leaf) and not own and (value is None or isinstance(value, str)):
            found[key] = "the composed hydra node"
    return found


def _composed_with_hydra(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    config.register_configs()
    preflight.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides, return_hydra_config=True)


def _leaves(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, DictConfig | ListConfig):
        if node._is_none() or node._is_missing():
            return
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for k in keys:
            yield from _leaves(node._get_node(k), f"{key}.{k}")
    else:
        yield key, node._value()


def run_dir_parts() -> set[str]:
    """The config keys the framework's run and sweep directories are formed from (``name``)."""
    cfg = _composed_with_hydra(["experiment=selfcheck"])
    raw = [cfg.hydra.run._get_node("dir")._value(), cfg.hydra.sweep._get_node("dir")._value()]
    return {m for text in raw for m in re.findall(r"\$\{([A-Za-z_][\w.]*)\}", text)}


def every_path_like_key() -> dict[str, tuple[str, list[str]]]:
    found = {k: (where, []) for k, where in schema_keys().items()}
    # TrainConfig.logger is a mergeable mapping (a logger file may add its own entry): its
    # settings are LoggerConfig's.
    found |= {k: (where, []) for k, where in schema_keys(LoggerConfig, "logger.").items()}
    found |= {k: (where, []) for k, where in hydra_keys().items()}
    return {**target_keys(), **found}


def test_the_enumeration_finds_the_doors_this_file_was_written_against():
    """A guard on the finder itself: it sees the keys the issue named, and every key the
    gate declares is one it finds (a stale declaration fails here)."""
    found = every_path_like_key()
    for key in ("logger.csv.filename", "logger.tensorboard_dir", "name", "dataset.root",
                "hydra.output_subdir", "hydra.launcher.submitit_folder", "resume"):  # fmt: skip
        assert key in found, sorted(found)
    declared = {*paths.CONFINED, *paths.UNDER, *paths.NOT_CONFINED}
    assert declared <= set(found), declared - set(found)
    assert "name" in run_dir_parts()


ATTACKS = ["absolute", "dotdot", "symlink"]


def _attack_value(key: str, how: str, world: Path) -> str:
    if how == "absolute":
        return str(world.parent / "outside" / "x")
    if how == "dotdot":
        return "../../x"
    whole = paths.UNDER.get(key)  # a whole path under the run or sweep dir
    if whole is None:
        return "lnk/x"
    return str(world / ("sweep" if whole == paths.SWEEP else "run") / "lnk" / "x")


@pytest.mark.parametrize("how", ATTACKS)
def test_every_path_like_key_is_confined_or_declared_chosen_and_each_attack_is_one_line(
    tmp_path, monkeypatch, capsys, how
):
    """Every key the enumeration finds, with an absolute path, '..' and a symlink that leads
    out: one ``error:`` line naming it, exit 2, nothing written. Keys a user points anywhere
    (a data root, a checkpoint to read) are declared in ``paths.NOT_CONFINED`` with why."""
    world, outside = tmp_path / "project", tmp_path / "outside"
    outside.mkdir()
    for base in ("run", "sweep", "outputs", "."):  # a symlink out in each base there is
        (world / base).mkdir(parents=True, exist_ok=True)
        (world / base / "lnk").symlink_to(outside)
    monkeypatch.chdir(world)  # the project root: outputs/, the TensorBoard index
    parts, tried = run_dir_parts(), []
    for key, (where, select) in sorted(every_path_like_key().items()):
        if key in paths.NOT_CONFINED:
            assert paths.NOT_CONFINED[key], f"{key}: say why it is not confined"
            continue
        sweep = key.startswith(("hydra.sweep.", "hydra.launcher."))
        argv = ["--multirun"] if sweep else []
        argv += ["experiment=selfcheck", *select, f"{key}={_attack_value(key, how, world)}"]
        if key not in parts:  # a key the run dir is formed from is tried with the default dir
            argv.append(f"hydra.sweep.dir={world / 'sweep'}" if sweep else
                        f"hydra.run.dir={world / 'run'}")  # fmt: skip
        monkeypatch.setattr(preflight, "_checked", False)
        monkeypatch.setattr(sys, "argv", ["train", *argv])
        with pytest.raises(SystemExit) as ended:
            preflight.cli_check()
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert ended.value.code == 2 and len(lines) == 1, f"{key} ({where}): {err}"
        assert lines[0].startswith("error: ") and REFUSAL.search(lines[0]), (key, lines[0])
        assert list(outside.iterdir()) == [], f"{key}: written outside"
        tried.append(key)
    assert {"logger.csv.filename", "name", "hydra.launcher.submitit_folder"} <= set(tried)
    assert sorted(p.name for p in (world / "run").iterdir()) == ["lnk"]


REFUSAL = re.compile(r"absolute|climbs out with '\.\.'|through a symlink|is not inside")
