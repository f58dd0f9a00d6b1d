"""One line, exit 2, for every bad input: a table across the tool entry points.

Each row is a command a user could type, with whatever it needs set up in a fresh temporary
directory (also the working directory, so default output folders land there too). Every row
must end with exit 2, exactly one stderr line starting ``error:`` that contains the row's
expected text, no ``Traceback`` anywhere, and no file created or changed: nothing
half-written that could look complete. Rows marked ``cheap`` do no training and import no
torch; rows that reach the trainer's own checks carry ``[trainer]`` in their test id
(``-k "not trainer"`` runs the cheap ones only).

Adding a row: append a ``Row`` to ``ROWS`` (or to a new list added to it). ``setup`` gets
the directory and returns nothing; ``argv`` gets the directory and returns the command.
Train overrides (the lead's preflight checks) fit the same shape: ``train(...)`` below.

Two ways each row runs (same assertions): in a fresh process, exactly as typed (every row;
the default tier keeps ``END_TO_END``, one row per entry point and code path, the rest are
``slow``), and in this process (``run_in_process``: the tool's ``__main__`` through runpy,
the trainer's preflight as its entry point calls it), which covers every cheap row in the
default tier for the price of a function call instead of an interpreter and a torch import.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import runpy
import subprocess
import sys
import tarfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, base_env, tool_module

PY = sys.executable
DRILL = str(REPO / "scripts" / "kill_resume_trials.py")
RECORD = {
    "status": "completed",
    "experiment_id": "badinputs",
    "seeds": {"base": 1, "source": "config"},
    "repro": {"level": "strict"},
    "git": {"commit": "0" * 40, "short": "00000000", "dirty": False},
    "data_fingerprint": {"sha256": "0" * 64},
    "epochs_completed": 1,
}
#: A record hand-edited from interrupted to completed: what the trainer never writes.
EDITED = {k: v for k, v in RECORD.items() if k != "epochs_completed"} | {
    "interrupted_at": "2026-01-01T00:00:00+00:00"
}
FINGERPRINT = {"epoch": 1, "global_step": 1, "weights_sha256": "0" * 64, "step_losses": [1.0]}


@dataclass
class Row:
    id: str
    argv: Callable[[Path], list[str]]
    expect: str
    setup: Callable[[Path], None] | None = None
    cheap: bool = True  # no trainer process, no torch import
    one_line: bool = True  # the whole of stderr is that one line
    env: dict[str, str] | None = None  # extra environment for the command


def tool(name: str, *args) -> Callable[[Path], list[str]]:
    """argv for ``python -m reprotrain.tools.<subject>.<name> args...`` (``report`` lives in
    the run-directory package: ``reprotrain.run.report``); a callable arg gets the dir."""
    module = "reprotrain.run.report" if name == "report" else tool_module(name)
    return lambda d: [PY, "-m", module, *[_arg(a, d) for a in args]]


def drill(*args) -> Callable[[Path], list[str]]:
    return lambda d: [PY, DRILL, *[_arg(a, d) for a in args]]


def train(*overrides: str) -> Callable[[Path], list[str]]:
    """For the trainer's own rows (train overrides that preflight must refuse)."""
    return lambda d: [PY, "-m", "reprotrain.train", *overrides, f"hydra.run.dir={d / 'run'}"]


def torchrun_check(nproc: str, *overrides: str) -> Callable[[Path], list[str]]:
    """What ``make train NPROC=<nproc> ARGS=...`` runs before torchrun starts."""
    code = "from reprotrain import preflight; preflight.torchrun_cli_check()"
    return lambda d: [PY, "-c", code, nproc, *overrides, f"hydra.run.dir={d / 'run'}"]


def _arg(a, d: Path) -> str:
    return str(a(d)) if callable(a) else str(a)


def at(rel: str) -> Callable[[Path], Path]:
    return lambda d: d / rel


# ------------------------------------------------------------------------------ fixtures


def write(d: Path, rel: str, data: str | bytes) -> Path:
    path = d / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def run_dir(
    record: dict | str | bytes | None = None, config: str = "name: x\n", **extra
) -> Callable:
    """A run directory ``d/run`` with the given run.json (dict, raw text, or None: absent)."""

    def setup(d: Path) -> None:
        (d / "run").mkdir()
        if record is not None:
            raw = json.dumps(record) if isinstance(record, dict) else record
            write(d, "run/run.json", raw)
        if config is not None:
            write(d, "run/config.resolved.yaml", config)
        for rel, text in extra.items():
            write(d, rel.replace("__", "/").replace("_dot_", "."), text)

    return setup


def members(**overrides) -> dict[str, bytes | None]:
    """The files of a minimal archive (under its top folder); ``None`` drops a file."""
    files: dict[str, bytes | None] = {
        "run/run.json": json.dumps(RECORD).encode(),
        "run/config.resolved.yaml": b"name: x\n",
        "run/fingerprints.jsonl": (json.dumps(FINGERPRINT) + "\n").encode(),
        "run/metrics.jsonl": b'{"epoch": 1}\n',
        "source/src/reprotrain/__init__.py": b"",
    }
    for key, value in overrides.items():
        files[key] = value.encode() if isinstance(value, str) else value
    return sealed({k: v for k, v in files.items() if v is not None})


def sealed(files: dict[str, bytes]) -> dict[str, bytes]:
    """run.json carrying its config's ``config_sha256``, as the trainer writes it (where both
    parse: a row about a broken record or config keeps it broken)."""
    import yaml

    from reprotrain.config import config_sha256

    try:  # a hostile document (an alias loop, deep nesting) stays as it was: not sealed
        record = json.loads(files["run/run.json"])
        config = yaml.safe_load(files["run/config.resolved.yaml"])
        if isinstance(record, dict) and isinstance(config, dict) and "config_sha256" not in record:
            record["config_sha256"] = config_sha256(config, record.get("extended_from") or None)
            files["run/run.json"] = json.dumps(record).encode()
    except (KeyError, ValueError, RecursionError, yaml.YAMLError):
        pass
    return files


def archive(
    files: dict[str, bytes] | None = None,
    *,
    manifest: bool | bytes = True,
    extra: list[tarfile.TarInfo] = (),
    name: str = "a.tar.gz",
    top: str = "top",
    after: Callable[[dict[str, bytes]], None] | None = None,
) -> Callable[[Path], None]:
    """Write ``d/<name>``: files under ``top/`` + a matching MANIFEST.sha256, then ``extra``
    members; ``after`` may change files once the manifest is computed (a tampered member)."""

    def setup(d: Path) -> None:
        content = dict(members() if files is None else files)
        digests = {rel: hashlib.sha256(data).hexdigest() for rel, data in content.items()}
        if after is not None:
            after(content)
        with tarfile.open(d / name, "w:gz") as tar:
            if manifest is not False:
                text = (
                    manifest
                    if isinstance(manifest, bytes)
                    else "".join(f"{digests[r]}  {r}\n" for r in sorted(digests)).encode()
                )
                content = {"MANIFEST.sha256": text, **content}
            for rel, data in content.items():
                info = tarfile.TarInfo(f"{top}/{rel}" if top else rel)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for info in extra:
                tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)

    return setup


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 1):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = size if kind == tarfile.REGTYPE else 0
    return info


def both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(d: Path) -> None:
        for s in setups:
            s(d)

    return setup


def a_file(rel: str = "file") -> Callable[[Path], None]:
    return lambda d: write(d, rel, "just a file\n") and None


def job_config(d: Path) -> str:
    """The real composed smoke config, for rows that reach the trainer."""
    out = subprocess.run(
        [PY, "-m", "reprotrain.train", "experiment=selfcheck", "--cfg", "job", "--resolve"],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


def real_run(d: Path) -> None:
    run_dir(RECORD, config=job_config(d))(d)


def _corrupt_gzip(d: Path) -> None:
    archive()(d)
    data = bytearray((d / "a.tar.gz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "a.tar.gz").write_bytes(bytes(data))


def another_models_checkpoint(d: Path) -> None:
    """The smoke run's record, with a checkpoint whose weights fit no ResNet of it."""
    import torch

    real_run(d)
    state = {
        "format_version": 2,
        "seeds": {"base": 1, "init": 1, "data": 1, "augment": 1, "train": 1, "source": "config"},
        "loop": {"global_step": 1, "epoch": 2, "step": 0},
        "model": {"fc.weight": torch.zeros(3, 3)},
    }
    (d / "run" / "checkpoints").mkdir()
    torch.save(state, d / "run" / "checkpoints" / "step-00000001.pt")
    write(d, "run/run.json", json.dumps({**RECORD, "seeds": state["seeds"]}))  # the run's own


def completed_run_with_checkpoint(d: Path) -> None:
    """A completed selfcheck record whose checkpoint holds that config (seed.base 42) at the
    end of its schedule: ``resume=auto`` with the same config is "already completed"."""
    import torch
    import yaml

    real_run(d)
    config = yaml.safe_load((d / "run" / "config.resolved.yaml").read_text())
    state = {
        "format_version": 2,
        "config": config,
        "seeds": {"base": 42, "init": 1, "data": 1, "augment": 1, "train": 1, "source": "config"},
        "loop": {"global_step": 8, "epoch": config["trainer"]["epochs"] + 1, "step": 0},
    }
    (d / "run" / "checkpoints").mkdir()
    torch.save(state, d / "run" / "checkpoints" / "step-00000008.pt")
    write(d, "run/.hydra/config.yaml", "name: how it started\n")


def orphan_checkpoints(d: Path) -> None:
    """A run directory with a checkpoint but no run.json (a lost record, or copied in)."""
    (d / "run").mkdir()
    write(d, "run/checkpoints/step-00000003.pt", b"PK\x03\x04 not read")


def another_runs_checkpoint(d: Path) -> None:
    """The run's record, and a checkpoint of another run (another seed) copied into it."""
    import torch

    another_models_checkpoint(d)
    path = d / "run" / "checkpoints" / "step-00000001.pt"
    state = torch.load(path, weights_only=True)
    state["seeds"] = {**state["seeds"], "base": 2}
    torch.save(state, path)


def used_sweep_dir(d: Path) -> None:
    write(d, "sweep/multirun.yaml", "hydra: {}\n")
    write(d, "sweep/0/run.json", json.dumps(RECORD))
    write(d, "sweep/0/.hydra/config.yaml", "name: x\n")


def _tamper(content: dict[str, bytes]) -> None:
    content["source/src/reprotrain/__init__.py"] = b"import os\n"


# ------------------------------------------------------------------------------ the table

RESUME = [
    Row("resume/no-args", tool("resume"), "the following arguments are required: run_dir"),
    Row("resume/missing-dir", tool("resume", at("nope")), "no such run directory"),
    Row("resume/a-file", tool("resume", at("file")), "not a directory", a_file()),
    Row("resume/no-run-json", tool("resume", at("run")), "not a reprotrain run", run_dir(None)),
    Row("resume/corrupt-run-json", tool("resume", at("run")), "invalid JSON at line 1",
        run_dir("{")),
    Row("resume/run-json-not-object", tool("resume", at("run")), "expected a JSON object",
        run_dir("[]")),
    Row("resume/run-json-not-utf8", tool("resume", at("run")), "not UTF-8",
        run_dir(b"\xff\xfe{")),
    Row("resume/yaml-syntax-error", tool("resume", at("run")),
        "config.resolved.yaml: line 3 column 1: YAML syntax error",
        run_dir(RECORD, config="a: [1,\n b: 2\n")),
    Row("resume/yaml-not-a-mapping", tool("resume", at("run")), "expected a YAML mapping",
        run_dir(RECORD, config="- 1\n")),
    Row("resume/unknown-option", tool("resume", "--bogus", at("run")), "unrecognized arguments",
        run_dir(RECORD)),
    Row("resume/bad-override", tool("resume", at("run"), "trainer.epoch=3"), "trainer.epoch",
        real_run, cheap=False),
    Row("resume/world-size-not-a-number", tool("resume", at("run")),
        "world_size 'two' is not a positive integer", run_dir({**RECORD, "world_size": "two"})),
    Row("resume/world-size-edited", tool("resume", at("run")),
        "world_size 2 but 1 rank(s) recorded",
        run_dir({**RECORD, "world_size": 2, "ranks": [{"rank": 0}]})),
    Row("resume/nproc-differs", tool("resume", at("run"), "--nproc", "2"),
        "recorded with world size 1, this resume has 2", run_dir(RECORD)),
]  # fmt: skip

EVAL = [
    Row("eval/run-json-not-object", tool("eval", at("run")), "expected a JSON object",
        run_dir("[]")),
    Row("eval/environment-not-object", tool("eval", at("run")),
        "environment is a str, not an object", run_dir({**RECORD, "environment": "cpu"})),
    Row("eval/another-models-checkpoint", tool("eval", at("run")),
        "does not fit the run's model", another_models_checkpoint, cheap=False),
    Row("eval/another-runs-checkpoint",
        tool("eval", at("run"), "--checkpoint", at("run/checkpoints/step-00000001.pt")),
        "is not a checkpoint of this run", another_runs_checkpoint, cheap=False),
    Row("report/environment-not-object", tool("report", at("run")),
        "environment is a str, not an object", run_dir({**RECORD, "environment": "cpu"})),
]  # fmt: skip

ARCHIVE = [
    Row("archive/no-args", tool("archive"), "the following arguments are required: run_dir"),
    Row("archive/missing-dir", tool("archive", at("nope")), "no such run directory"),
    Row("archive/a-file", tool("archive", at("file")), "not a directory", a_file()),
    Row("archive/no-run-json", tool("archive", at("run")), "not a reprotrain run directory",
        run_dir(None)),
    Row("archive/ranks-contradict-world-size", tool("archive", at("run")),
        "world_size 1 but 7 rank(s) recorded",
        run_dir({**RECORD, "world_size": 1, "ranks": [{"rank": i} for i in range(7)]})),
    Row("archive/corrupt-run-json", tool("archive", at("run")), "invalid JSON at line 1",
        run_dir('{"status": ')),
    Row("archive/run-json-not-object", tool("archive", at("run")), "expected a JSON object",
        run_dir("3")),
    Row("archive/incomplete", tool("archive", at("run")), "not completed",
        run_dir({**RECORD, "status": "running"})),
    Row("archive/out-dir-is-a-file", tool("archive", at("run"), "--out-dir", at("file")),
        "Not a directory", both(run_dir(RECORD), a_file())),
    Row("archive/out-dir-under-a-file",
        tool("archive", at("run"), "--out-dir", lambda d: d / "file" / "sub"),
        "Not a directory", both(run_dir(RECORD), a_file())),
    Row("archive/exists-without-force", tool("archive", at("run"), "--out-dir", at("out")),
        "exists; pass --force",
        both(run_dir(RECORD), a_file("out/badinputs-run.tar.gz"))),
    Row("archive/sign-key-missing", tool("archive", at("run"), "--sign", at("nokey")),
        "signing key", run_dir(RECORD)),
    Row("archive/repo-missing", tool("archive", at("run"), "--repo", at("norepo")),
        "No such file or directory", run_dir(RECORD)),
    Row("archive/commit-not-here", tool("archive", at("run"), "--out-dir", at("out")),
        "is not in", run_dir(RECORD)),
    Row("archive/commit-is-an-option", tool("archive", at("run"), "--out-dir", at("out")),
        "is not a git object id",
        run_dir({**RECORD, "git": {"commit": "--output=/tmp/x"}})),
    Row("archive/unknown-option", tool("archive", at("run"), "--bogus"),
        "unrecognized arguments", run_dir(RECORD)),
    Row("archive/completed-by-hand", tool("archive", at("run"), "--out-dir", at("out")),
        "says completed but records no epochs_completed", run_dir(EDITED)),
]  # fmt: skip

REPRODUCE = [
    Row("reproduce/no-args", tool("reproduce"), "the following arguments are required: archive"),
    Row("reproduce/missing", tool("reproduce", at("nope.tar.gz")), "no such archive"),
    Row("reproduce/a-directory", tool("reproduce", at("d")), "not a file",
        lambda d: (d / "d").mkdir()),
    Row("reproduce/not-a-tar", tool("reproduce", at("file")), "not a readable tar archive",
        a_file()),
    Row("reproduce/corrupt-gzip", tool("reproduce", at("a.tar.gz")), "corrupt gzip stream",
        _corrupt_gzip),
    Row("reproduce/empty-tar", tool("reproduce", at("a.tar.gz")), "the archive is empty",
        lambda d: tarfile.open(d / "a.tar.gz", "w:gz").close()),
    Row("reproduce/no-manifest", tool("reproduce", at("a.tar.gz")), "no MANIFEST.sha256",
        archive(manifest=False)),
    Row("reproduce/malformed-manifest", tool("reproduce", at("a.tar.gz")), "malformed",
        archive(manifest=b"not a manifest line\n")),
    Row("reproduce/member-changed", tool("reproduce", at("a.tar.gz")), "member changed",
        archive(after=_tamper)),
    Row("reproduce/extra-member", tool("reproduce", at("a.tar.gz")),
        "is in the archive but not in", archive(extra=[member("top/run/extra.txt")])),
    Row("reproduce/dotdot-member", tool("reproduce", at("a.tar.gz")), "unsafe member",
        archive(extra=[member("top/../../evil")])),
    Row("reproduce/absolute-member", tool("reproduce", at("a.tar.gz")), "absolute path",
        archive(extra=[member("/tmp/reprotrain-evil")])),
    Row("reproduce/symlink-member", tool("reproduce", at("a.tar.gz")), "symlink",
        archive(extra=[member("top/link", tarfile.SYMTYPE, "/etc/passwd")])),
    Row("reproduce/device-member", tool("reproduce", at("a.tar.gz")), "device file",
        archive(extra=[member("top/dev", tarfile.CHRTYPE)])),
    Row("reproduce/duplicate-member", tool("reproduce", at("a.tar.gz")), "appears twice",
        archive(extra=[member("top/./run/metrics.jsonl")])),
    Row("reproduce/two-runs-in-one", tool("reproduce", at("a.tar.gz")),
        "MANIFEST.sha256 files at the top",
        archive(extra=[member("other/MANIFEST.sha256")])),
    Row("reproduce/no-run-json", tool("reproduce", at("a.tar.gz")), "run/run.json is missing",
        archive(members(**{"run/run.json": None}))),
    Row("reproduce/invalid-run-json", tool("reproduce", at("a.tar.gz")), "invalid JSON",
        archive(members(**{"run/run.json": "{nope"}))),
    Row("reproduce/no-seeds", tool("reproduce", at("a.tar.gz")), "no integer seeds.base",
        archive(members(**{"run/run.json": json.dumps({**RECORD, "seeds": None})}))),
    Row("reproduce/no-repro-level", tool("reproduce", at("a.tar.gz")), "no repro.level",
        archive(members(**{"run/run.json": json.dumps({**RECORD, "repro": {}})}))),
    Row("reproduce/yaml-syntax-error", tool("reproduce", at("a.tar.gz")),
        "run/config.resolved.yaml: line 2 column 4: YAML syntax error",
        archive(members(**{"run/config.resolved.yaml": "a: 1\n  b: 2\n"}))),
    Row("reproduce/config-not-a-mapping", tool("reproduce", at("a.tar.gz")),
        "expected a YAML mapping", archive(members(**{"run/config.resolved.yaml": "just text"}))),
    Row("reproduce/bad-fingerprints", tool("reproduce", at("a.tar.gz")),
        "fingerprints.jsonl line 1", archive(members(**{"run/fingerprints.jsonl": "{}\n"}))),
    Row("reproduce/no-source", tool("reproduce", at("a.tar.gz")), "no source snapshot",
        archive(members(**{"source/src/reprotrain/__init__.py": None}))),
    Row("reproduce/no-completed-epoch", tool("reproduce", at("a.tar.gz")), "completed no epoch",
        archive(members(**{"run/fingerprints.jsonl": "",
                            "run/run.json": json.dumps({**RECORD, "epochs_completed": 0})}))),
    Row("reproduce/env-value-missing-here", tool("reproduce", at("a.tar.gz"), "--trust"),
        "name = ${oc.env:REPROTRAIN_TEST_UNSET_VAR} cannot be resolved here",
        archive(members(**{
            "run/run.json": json.dumps({**RECORD, "env_interpolations": {"name": {
                "interpolation": "${oc.env:REPROTRAIN_TEST_UNSET_VAR}", "sha256": "0" * 64}}}),
            "run/config.resolved.yaml": "name: ${oc.env:REPROTRAIN_TEST_UNSET_VAR}\n"}))),
    # Issue 26: a record that contradicts itself, and an archive that sets the re-run's
    # environment (refused under every trust rule, --trust included).
    Row("reproduce/world-size-not-a-number", tool("reproduce", at("a.tar.gz")),
        "world_size 'two' is not a positive integer",
        archive(members(**{"run/run.json": json.dumps({**RECORD, "world_size": "two"})}))),
    Row("reproduce/gpu-env-not-a-mapping", tool("reproduce", at("a.tar.gz")),
        "environment.gpu_env is a list, not an object", archive(members(**{
            "run/run.json": json.dumps({**RECORD, "environment": {"gpu_env": [1]}})}))),
    Row("reproduce/archive-sets-pythonpath", tool("reproduce", at("a.tar.gz"), "--trust"),
        "asks to set $PYTHONPATH in the re-run's environment", archive(members(**{
            "run/run.json": json.dumps({**RECORD, "environment": {
                "gpu_env": {"PYTHONPATH": "src:../run/evil"}}})}))),
    Row("reproduce/archive-sets-git-trace", tool("reproduce", at("a.tar.gz"), "--trust"),
        "$GIT_TRACE", archive(members(**{
            "run/run.json": json.dumps({**RECORD, "environment": {
                "gpu_env": {"GIT_TRACE": "/tmp/victim"}}})}))),
    Row("reproduce/epochs-beyond-the-run", tool("reproduce", at("a.tar.gz"), "--epochs", "5"),
        "has 1 completed epoch", archive()),
    Row("reproduce/epochs-zero", tool("reproduce", at("a.tar.gz"), "--epochs", "0"),
        "invalid positive integer value", archive()),
    Row("reproduce/tolerance-nan", tool("reproduce", at("a.tar.gz"), "--tolerance", "nan"),
        "invalid finite non-negative number value", archive()),
    Row("reproduce/extract-dir-is-a-file",
        tool("reproduce", at("a.tar.gz"), "--extract-dir", at("file")), "Not a directory",
        both(archive(), a_file())),
    Row("reproduce/extract-dir-not-empty",
        tool("reproduce", at("a.tar.gz"), "--extract-dir", at("full")), "is not empty",
        both(archive(), a_file("full/x"))),
    Row("reproduce/runs-dir-is-a-file",
        tool("reproduce", at("a.tar.gz"), "--runs-dir", at("file")), "Not a directory",
        both(archive(), a_file())),
    Row("reproduce/trusted-signers-missing",
        tool("reproduce", at("a.tar.gz"), "--trusted-signers", at("nofile")),
        "No such file or directory", archive()),
    Row("reproduce/completed-by-hand", tool("reproduce", at("a.tar.gz")),
        "an inconsistent record is not replayed",
        archive(members(**{"run/run.json": json.dumps(EDITED)}))),
    Row("reproduce/file-dir-clash", tool("reproduce", at("a.tar.gz"), "--verify-only"),
        "is a file and also a directory",
        archive(members(**{"run/git.diff": "a file", "run/git.diff/x": "a dir"}))),
    Row("reproduce/too-many-members", tool("reproduce", at("a.tar.gz"), "--max-members", "3"),
        "more than 3 members", archive()),
    Row("reproduce/member-over-limit",
        tool("reproduce", at("a.tar.gz"), "--max-member-bytes", "4"),
        "over the per-member limit", archive()),
    Row("reproduce/ratio-zero", tool("reproduce", at("a.tar.gz"), "--max-ratio", "0"),
        "invalid finite positive number value", archive()),
    Row("reproduce/untrusted-code",
        tool("reproduce", at("a.tar.gz"), "--allow-data-drift", "--runs-dir", at("runs")),
        "refusing to run the archive's code", lambda d: archive(members(**{
            "run/config.resolved.yaml": job_config(d)}))(d), cheap=False),
]  # fmt: skip

VERIFY = [
    Row("verify/run-dir-override", tool("verify", "hydra.run.dir=x"),
        "verify chooses the run directories"),
    Row("verify/multirun", tool("verify", "--multirun", "seed.base=1,2"),
        "--multirun is not supported"),
    Row("verify/unknown-option", tool("verify", "--bogus"), "unrecognized arguments"),
    Row("verify/out-dir-is-a-file", tool("verify", "--out-dir", at("file"), "experiment=selfcheck"),
        "Not a directory", a_file()),
    Row("verify/bad-override", tool("verify", "--out-dir", at("v"), "experiment=selfcheck",
                                    "trainer.epoch=3"),
        "trainer.epoch", cheap=False),
]  # fmt: skip

DRILL_ROWS = [
    Row("drill/zero-trials", drill("--trials", "0"), "invalid trial count (at least 1) value"),
    Row("drill/negative-trials", drill("--trials", "-1"), "invalid trial count"),
    Row("drill/trials-not-a-number", drill("--trials", "x"), "invalid trial count"),
    Row("drill/out-is-a-file", drill("--trials", "1", "--out", at("file")), "Not a directory",
        a_file()),
    Row("drill/bad-override",
        drill("--trials", "1", "--out", at("o"), "experiment=selfcheck", "trainer.epoch=3"),
        "trainer.epoch", cheap=False),
]  # fmt: skip

OTHER = [
    Row("check_lock/lock-without-in", tool("check_lock", "--lock", "x"), "one --in per --lock"),
]

# The trainer's own rows: preflight refuses them before a run directory exists (each pays
# one torch import; none trains).
TRAIN = [
    Row("train/typo", train("experiment=selfcheck", "trainer.epoch=3"), "trainer.epoch"),
    Row("train/plus-typo", train("experiment=selfcheck", "+trainer.epoch=3"), "trainer.epoch"),
    Row("train/wrong-type", train("experiment=selfcheck", "trainer.epochs=abc"), "trainer.epochs"),
    Row("train/unknown-option", train("model=resnet999"), "resnet999"),
    Row("train/zero-batch", train("experiment=selfcheck", "trainer.batch_size=0"), "batch_size"),
    Row("train/negative-lr", train("experiment=selfcheck", "optimizer.lr=-1"), "optimizer.lr"),
    Row("train/inf-lr", train("experiment=selfcheck", "optimizer.lr=inf"), "optimizer.lr"),
    Row("train/nan-warmup", train("experiment=selfcheck", "scheduler.warmup_fraction=nan"),
        "scheduler.warmup_fraction"),
    Row("train/short-betas",
        train("experiment=selfcheck", "optimizer=adamw", "optimizer.betas=[0.9]"),
        "optimizer.betas"),
    Row("train/nesterov-without-momentum", train("experiment=selfcheck", "optimizer.momentum=0"),
        "optimizer.nesterov"),
    Row("train/seed-over-64-bits", train("experiment=selfcheck", "seed.train=18446744073709551616"),
        "seed.train"),
    Row("train/threads", train("experiment=selfcheck", "repro.num_threads=1099511627776"),
        "repro.num_threads"),
    Row("train/unknown-model-key", train("experiment=selfcheck", "+model.depth=3"), "'depth'"),
    Row("train/unimportable-target", train("experiment=selfcheck", "model._target_=no.such.Net"),
        "no.such.Net"),
    Row("train/bad-level", train("experiment=selfcheck", "repro.level=loose"), "repro.level"),
    Row("train/bad-device", train("experiment=selfcheck", "trainer.device=tpu"), "trainer.device"),
    Row("train/run-dir-through-a-file",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=selfcheck",
                   f"hydra.run.dir={d / 'file' / 'run'}"], "is a file", a_file()),
    Row("train/run-dir-name-too-long",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=selfcheck",
                   f"hydra.run.dir={d / ('x' * 300)}"], "255"),
    Row("train/run-dir-over-path-max",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=smoke",
                   f"hydra.run.dir={d / '/'.join(['x' * 200] * 25)}"], "for a whole path"),
    Row("train/non-ascii-run-dir-in-an-ascii-locale",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=smoke",
                   f"hydra.run.dir={d / 'läuft'}"], "not valid text in this locale",
        env={"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}),
    Row("train/fresh-run-into-a-used-run-dir", train("experiment=smoke", "seed.base=7"),
        "already holds a run (run.json, status completed)",
        run_dir(RECORD, **{"run__.hydra__config_dot_yaml": "name: old\n"})),
    Row("train/fork-into-a-used-run-dir",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=smoke",
                   f"resume={d / 'other' / 'step-00000001.pt'}", f"hydra.run.dir={d / 'run'}"],
        "a fork from resume=", run_dir(RECORD)),
    Row("train/sweep-into-a-used-sweep-dir",
        lambda d: [PY, "-m", "reprotrain.train", "--multirun", "experiment=smoke",
                   "seed.base=0,1", f"hydra.sweep.dir={d / 'sweep'}"],
        "already holds a sweep (1 run(s))", used_sweep_dir),
    # Issue 26, point 4: refused at startup, before Hydra writes a run directory.
    Row("train/num-workers-on-the-device-pipeline",
        train("experiment=selfcheck", "trainer.num_workers=2"), "needs trainer.pipeline=loader"),
    Row("train/num-classes-against-the-dataset",
        train("experiment=selfcheck", "model.num_classes=5"), "but the dataset has 10 classes"),
    Row("train/mean-of-the-wrong-length", train("experiment=selfcheck", "dataset.mean=[0.5,0.5]"),
        "dataset.mean has 2 values but dataset.std has 3"),
    Row("train/std-with-a-zero", train("experiment=selfcheck", "dataset.std=[0.25,0,0.25]"),
        "must be > 0 in every channel"),
    Row("train/fresh-run-over-checkpoints-without-run-json", train("experiment=selfcheck"),
        "holds 1 checkpoint file(s) (step-00000003.pt, ...) but no run.json", orphan_checkpoints),
    Row("train/resume-auto-over-checkpoints-without-run-json",
        train("experiment=selfcheck", "resume=auto"), "but no run.json", orphan_checkpoints),
    # Issue 45, point 6: another run's files without its run.json are never trained over.
    Row("train/fresh-run-over-another-runs-metrics-and-config", train("experiment=selfcheck"),
        "holds metrics.jsonl, config.resolved.yaml but no run.json",
        run_dir(None, run__metrics_dot_jsonl='{"epoch": 1}\n')),
    Row("train/resume-auto-into-a-completed-run-with-another-config",
        train("experiment=selfcheck", "seed.base=7", "resume=auto"),
        "config differs from the recorded one in seed.base (42 -> 7)",
        completed_run_with_checkpoint, cheap=False),
    # Issue 52, points 2 and 3: a path a config names stays inside; a directory reprotrain
    # did not make is never written (nothing created here: the working directory is d).
    Row("train/name-climbs-out-of-outputs",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=selfcheck", "name=../../x"],
        "name=../../x: it climbs out with '..'"),
    Row("train/csv-file-outside-the-run",
        train("experiment=selfcheck", "logger=csv", "logger.csv.filename=/tmp/x.csv"),
        "logger.csv.filename=/tmp/x.csv: it is absolute"),
    Row("train/into-another-hydra-apps-output-dir", train("experiment=selfcheck"),
        "holds no reprotrain record (run.json)",
        run_dir(None, None, **{"run__.hydra__config_dot_yaml": "lr: 0.5\n",
                                "run__app_dot_log": "other app\n"})),
    # Point 7: one line for every bad value.
    Row("train/resume-from-a-file-that-is-not-a-checkpoint",
        lambda d: [PY, "-m", "reprotrain.train", "experiment=selfcheck",
                   f"resume={d / 'file'}"], "file is not a checkpoint", a_file()),
    Row("train/several-values-without-multirun",
        train("experiment=selfcheck", "trainer.epochs=3,4"),
        "add --multirun"),
    Row("train/nproc-zero", torchrun_check("0", "experiment=selfcheck"),
        "NPROC=0: give at least 1 process"),
    Row("train/nproc-negative", torchrun_check("-1", "experiment=selfcheck"),
        "NPROC=-1: give at least 1 process"),
    Row("train/nproc-not-a-number", torchrun_check("abc", "experiment=selfcheck"),
        "NPROC=abc: not a number of processes"),
]  # fmt: skip

ROWS = RESUME + EVAL + ARCHIVE + REPRODUCE + VERIFY + DRILL_ROWS + TRAIN + OTHER


def _state(d: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(d).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in d.rglob("*")
        if p.is_file() or p.is_dir()
    }


# One row per entry point and per code path, run end to end (a fresh interpreter) in the
# default tier: each tool's record reading, argparse, the archive reader, the preflight
# before torch, the component check after it, the run-dir checks, a sweep, the locale (its
# environment must be set before the interpreter starts) and one row that reaches the
# trainer. The slow tier runs every other row end to end too.
END_TO_END = {
    "resume/corrupt-run-json",
    "resume/nproc-differs",
    "eval/environment-not-object",
    "report/environment-not-object",
    "archive/no-args",
    "archive/incomplete",
    "reproduce/dotdot-member",
    "reproduce/epochs-zero",
    "verify/run-dir-override",
    "drill/zero-trials",
    "check_lock/lock-without-in",
    "train/typo",
    "train/unknown-model-key",
    "train/run-dir-through-a-file",
    "train/non-ascii-run-dir-in-an-ascii-locale",
    "train/sweep-into-a-used-sweep-dir",
    "train/num-classes-against-the-dataset",
    "train/nproc-zero",
    "resume/bad-override",
}


def _params(rows: list[Row]):
    return [
        pytest.param(
            r,
            id=r.id if r.cheap else f"{r.id}[trainer]",
            marks=() if r.id in END_TO_END else pytest.mark.slow,
        )
        for r in rows
    ]


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``argv`` run in this interpreter, as Python would run
    it: ``-m reprotrain.tools.<x>`` and scripts through runpy as ``__main__``; the trainer
    up to where its entry point stops a bad command line (``preflight.cli_check``, before
    Hydra starts a run). An exception that escapes is printed as the interpreter would."""
    from reprotrain import preflight

    _, *cmd = argv
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    saved_argv = sys.argv[:]
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        # runpy's note that an earlier row (or test) already imported the tool's module
        warnings.filterwarnings("ignore", "'reprotrain", RuntimeWarning, "runpy")
        try:
            if cmd[:2] == ["-m", "reprotrain.train"]:
                sys.argv = ["reprotrain.train", *cmd[2:]]
                preflight._checked = False
                preflight.cli_check()
            elif cmd[0] == "-c":  # python -c CODE args...: what make runs before torchrun
                sys.argv = ["-c", *cmd[2:]]
                preflight._checked = False
                exec(compile(cmd[1], "<string>", "exec"), {"__name__": "__main__"})
            elif cmd[0] == "-m":
                sys.argv = [cmd[1], *cmd[2:]]
                runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = cmd
                runpy.run_path(cmd[0], run_name="__main__")
        except SystemExit as e:
            code = e.code
        except BaseException:  # what the interpreter would print, and its exit status
            traceback.print_exc()
            code = 1
        finally:
            sys.argv = saved_argv
            preflight._checked = False
    if isinstance(code, str):  # sys.exit("text"): printed on stderr, exit 1
        err.write(code + "\n")
        code = 1
    return (code or 0), out.getvalue(), err.getvalue()


def _assert_refused(row: Row, d: Path, before: dict, code: int, stdout: str, stderr: str) -> None:
    shown = f"exit {code}\nstdout: {stdout[-2000:]}\nstderr: {stderr[-2000:]}"
    assert code == 2, shown
    assert "Traceback" not in stdout + stderr, shown
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, shown
    assert row.expect in errors[0], shown
    if row.one_line:
        assert [x for x in stderr.splitlines() if x.strip()] == errors, shown
    assert _state(d) == before, "nothing was written or changed"
    assert not list(d.rglob("*.tar.gz.tmp")) and not list(d.rglob("reproduction.json"))


def test_the_table_covers_every_entry_point_with_enough_rows():
    kinds = {r.id.split("/")[0] for r in ROWS}
    assert {"resume", "archive", "reproduce", "verify", "drill", "train"} <= kinds
    assert len(ROWS) >= 60
    assert sum(r.cheap for r in ROWS) >= 35
    assert len({r.id for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", _params(ROWS))
def test_a_bad_input_is_one_line_and_exit_2(row: Row, tmp_path: Path):
    if row.setup is not None:
        row.setup(tmp_path)
    before = _state(tmp_path)
    proc = subprocess.run(
        row.argv(tmp_path),
        cwd=tmp_path,
        env=base_env(**(row.env or {})),
        capture_output=True,
        text=True,
        timeout=300,
    )
    _assert_refused(row, tmp_path, before, proc.returncode, proc.stdout, proc.stderr)


# Rows whose refusal needs a process of their own: an environment read at interpreter start
# (the locale), or a trainer process started by the tool. They run end to end only.
IN_PROCESS = [r for r in ROWS if r.cheap and r.env is None]


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in IN_PROCESS])
def test_a_bad_input_in_process_is_one_line_and_exit_2(row: Row, tmp_path: Path, monkeypatch):
    for key in [k for k in os.environ if k.startswith("REPROTRAIN_TEST")]:
        monkeypatch.delenv(key)
    if row.setup is not None:
        row.setup(tmp_path)
    before = _state(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run_in_process(row.argv(tmp_path))
    _assert_refused(row, tmp_path, before, code, stdout, stderr)


def test_the_end_to_end_rows_cover_every_entry_point_and_every_row_runs_somewhere():
    """The default tier's fresh-process rows reach every entry point, the trainer among them;
    a row left out of both the in-process list and END_TO_END still runs in the slow tier."""
    by_id = {r.id: r for r in ROWS}
    assert set(by_id) >= END_TO_END, END_TO_END - set(by_id)
    kinds = {r.id.split("/")[0] for r in ROWS}
    assert {by_id[i].id.split("/")[0] for i in END_TO_END} == kinds
    assert any(not by_id[i].cheap for i in END_TO_END)
    assert any(by_id[i].env for i in END_TO_END)
    in_default = END_TO_END | {r.id for r in IN_PROCESS}
    assert {r.id for r in ROWS if r.cheap} <= in_default


def test_fixtures_are_what_they_claim(tmp_path):
    """Controls: the minimal archive is well formed, so each row's refusal is its own."""
    archive()(tmp_path)
    from reprotrain.tools.archive import archive_check

    checked = archive_check.check_record(archive_check.verify(tmp_path / "a.tar.gz"))
    assert checked.record["seeds"]["base"] == 1 and len(checked.fingerprints) == 1
    with gzip.open(tmp_path / "a.tar.gz") as f:
        assert f.read(1)
