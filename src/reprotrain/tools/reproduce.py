"""``make reproduce ARCHIVE=<file>``: replay an archived run from its own source and compare.

    python -m reprotrain.tools.reproduce archives/<id>-<run>.tar.gz [--epochs N]
        [--tolerance 0.02] [--allow-data-drift] [--runs-dir outputs/reproduce]
        [--extract-dir DIR] [--verify-only]

Steps, each of which can stop the replay:

1. **Check the archive before writing anything.** Every member must be a plain file or a
   directory under one top folder (no absolute paths, no ``..``, no links, no devices), and
   every file must match ``MANIFEST.sha256`` (no member changed, missing or extra). Only
   then is it extracted (``tarfile`` ``filter="data"`` as a second guard) into a fresh
   directory (a temp one unless ``--extract-dir``).
2. **Data.** ``data_fingerprint`` of the recorded dataset config, computed here and now,
   must equal the one in ``run.json`` (refused unless ``--allow-data-drift``).
3. **Environment and code.** python/torch/numpy/CUDA/cuDNN/device/threads and the sha256 of
   this checkout's ``requirements.lock`` against the recorded ones; the recorded commit and
   diff against this checkout's HEAD (informational: the replay uses the archived source).
4. **Re-run** ``python -m reprotrain.train`` with the archived ``config.resolved.yaml`` under
   the schema, the recorded seeds (``seed.base`` pinned when it came from entropy) and
   ``PYTHONHASHSEED``, from the archived source snapshot: ``PYTHONPATH=<snapshot>/src``,
   cwd = the snapshot root, so ``import reprotrain`` is the archived code, not this checkout
   (checked before the run). The new run goes to ``<runs-dir>/<stamp>/`` with a
   ``reproduction.json`` beside its ``run.json``. ``--epochs N`` re-runs only the first N
   epochs (``trainer.stop_after_epoch=N``, same LR schedule) and compares those.
5. **Compare** per-epoch fingerprints and final weights (``tools/compare.py``).

Verdict (last line) and exit code:

    0  REPRODUCED (bitwise)         every compared epoch and the final weights match
    1  DIVERGED at epoch E (step S) first divergence, with the metric differences
    2  refused (one line): bad/tampered/unsafe archive, data drift, bad arguments
    3  NOT COMPARABLE               environment differs, repro level fast, nondeterministic
                                    ops recorded, or data drift allowed: bits are not
                                    expected to match; metrics are judged against
                                    --tolerance (absolute, on *_acc and *_loss) instead
    4  the re-run itself failed     (its log is in the new run directory)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path, PurePosixPath

from omegaconf import OmegaConf

from reprotrain.paths import REPO_ROOT
from reprotrain.repro import environment, lockfile
from reprotrain.repro.record import RESOLVED_CONFIG, RUN_JSON, atomic_write_text, now_iso
from reprotrain.safetar import unsafe_reason
from reprotrain.tools.archive import MANIFEST, parse_manifest
from reprotrain.tools.compare import compare_runs

EXIT_REPRODUCED, EXIT_DIVERGED, EXIT_REFUSED, EXIT_NOT_COMPARABLE, EXIT_RERUN_FAILED = range(5)
DEFAULT_TOLERANCE = 0.02
PRIMARY = "reproduce"
REPORT = "reproduction.json"
#: Recorded environment keys whose difference means identical bits are not expected.
ENV_KEYS = ("python", "torch", "numpy", "cuda", "cudnn", "machine", "num_threads")
#: Shown when they differ, but not a reason on their own (kernel build, allowlisted vars).
INFO_KEYS = ("os",)


class Refusal(Exception):
    """The archive or its data cannot be replayed as is: one line, exit 2."""


# ----------------------------------------------------------------------------- the archive


def check_members(tar: tarfile.TarFile) -> tuple[str, list[tarfile.TarInfo]]:
    """(top folder, members) after refusing anything unsafe; nothing is written."""
    members = tar.getmembers()
    if not members:
        raise Refusal("the archive is empty")
    top = PurePosixPath(members[0].name).parts[0] if members[0].name else ""
    seen: set[str] = set()
    for m in members:
        why = unsafe_reason(m)
        if why is None and (PurePosixPath(m.name).parts or ("",))[0] != top:
            why = f"outside the top folder {top!r}"
        if why is None and top in (".", ""):
            why = "no top folder"
        if why is not None:
            raise Refusal(f"unsafe member {m.name!r} ({why}); nothing extracted")
        name = PurePosixPath(m.name).as_posix()
        if name in seen:
            raise Refusal(f"member {m.name!r} appears twice; nothing extracted")
        seen.add(name)
    return top, members


def verify_manifest(tar: tarfile.TarFile, top: str, members: list[tarfile.TarInfo]) -> int:
    """Every file member hashes to its MANIFEST.sha256 line; none missing, none extra."""
    files = {PurePosixPath(m.name).relative_to(top).as_posix(): m for m in members if m.isreg()}
    if MANIFEST not in files:
        raise Refusal(f"no {top}/{MANIFEST} in the archive; not a reprotrain archive")
    try:
        expected = parse_manifest(tar.extractfile(files.pop(MANIFEST)).read().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise Refusal(f"manifest check failed: {e}") from None
    for rel in sorted(set(expected) - set(files)):
        raise Refusal(f"manifest check failed: {top}/{rel} is in {MANIFEST} but not in the archive")
    for rel in sorted(set(files) - set(expected)):
        raise Refusal(f"manifest check failed: {top}/{rel} is in the archive but not in {MANIFEST}")
    for rel in sorted(files):
        h = hashlib.sha256()
        f = tar.extractfile(files[rel])
        for chunk in iter(lambda f=f: f.read(1 << 20), b""):
            h.update(chunk)
        if h.hexdigest() != expected[rel]:
            raise Refusal(
                f"manifest check failed: {top}/{rel} sha256 {h.hexdigest()[:12]} != "
                f"recorded {expected[rel][:12]} (member changed)"
            )
    return len(files)


def check_compression(archive: Path) -> None:
    """Read a gzip stream to its end so its CRC is checked (tarfile stops at the first bad
    header and would report a corrupt archive as merely missing members)."""
    with open(archive, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            return
    try:
        with gzip.open(archive, "rb") as f:
            while f.read(1 << 20):
                pass
    except (OSError, EOFError, zlib.error) as e:
        raise Refusal(f"{archive}: corrupt gzip stream ({e}); nothing extracted") from None


def open_checked(archive: Path, dest: Path) -> Path:
    """Check ``archive`` fully, then extract it into ``dest`` (new or empty); returns top dir."""
    archive = Path(archive)
    if not archive.is_file():
        raise Refusal(f"{archive}: no such archive")
    check_compression(archive)
    try:
        with tarfile.open(archive, "r:*") as tar:
            top, members = check_members(tar)
            verify_manifest(tar, top, members)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise Refusal(f"{archive}: not a readable tar archive ({e})") from None
    if dest.exists() and any(dest.iterdir()):
        raise Refusal(f"extract dir {dest} is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        # Second guard: same member list, checked again by tarfile's "data" filter.
        tar.extractall(dest, members=check_members(tar)[1], filter="data")
    return dest / top


# ----------------------------------------------------------------------------- the checks


def current_data_dir(recorded_root: str) -> Path:
    root = Path(recorded_root)
    return root if root.is_absolute() else REPO_ROOT / root


def check_data(dataset_cfg, recorded: dict | None, allow_drift: bool) -> str | None:
    """None when the data here is the data the run saw; else a message (refusal unless
    ``allow_drift``, when it becomes a NOT COMPARABLE reason)."""
    from reprotrain.data.datasets import data_fingerprint

    here = data_fingerprint(dataset_cfg)
    want = (recorded or {}).get("sha256")
    if want is not None and here.get("sha256") == want:
        return None
    got = here.get("sha256") or f"none (missing: {', '.join(here.get('missing', [])) or '?'})"
    msg = f"data differs from the archived run: recorded sha256 {want}, here {got}"
    if not allow_drift:
        raise Refusal(msg + " (pass --allow-data-drift to re-run anyway)")
    return msg


def _differences(recorded: dict, here: dict, keys, label: str = "{}") -> list[str]:
    return [
        f"{label.format(k)}: recorded {recorded.get(k)!r}, here {here.get(k)!r}"
        for k in keys
        if recorded.get(k) != here.get(k)
    ]


def environment_differences(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(differences that rule out identical bits, informational ones), both as text."""
    renv, cenv = recorded.get("environment") or {}, current.get("environment") or {}
    rdev, cdev = renv.get("device") or {}, cenv.get("device") or {}
    blocking = _differences(renv, cenv, ENV_KEYS)
    blocking += _differences(rdev, cdev, sorted(set(rdev) | set(cdev)), "device.{}")
    if recorded.get("lock_sha256") != current.get("lock_sha256"):
        blocking.append(
            f"lock_sha256: recorded {str(recorded.get('lock_sha256'))[:12]}, this checkout's "
            f"requirements.lock {str(current.get('lock_sha256'))[:12]}"
        )
    drift = current.get("env_drift") or {}
    if drift.get("status") == "drift":
        names = drift.get("missing", []) + drift.get("extra", [])
        names += [d["name"] for d in drift.get("different", [])]
        blocking.append(f"installed packages differ from the archived lock: {', '.join(names)}")
    rvars, cvars = renv.get("env") or {}, cenv.get("env") or {}
    info = _differences(renv, cenv, INFO_KEYS)
    info += _differences(rvars, cvars, sorted(set(rvars) | set(cvars)), "${}")
    return blocking, info


def code_differences(recorded_git: dict, repo: Path = REPO_ROOT) -> list[str]:
    """Recorded commit/dirty vs this checkout (the replay runs the archived source anyway)."""
    now, diff = environment.git_info(repo)
    out = []
    if now.get("commit") is None:
        out.append(f"{repo} is not a git checkout")
    elif now["commit"] != recorded_git.get("commit"):
        out.append(
            f"commit: recorded {str(recorded_git.get('commit'))[:12]}, "
            f"this checkout {now['commit'][:12]}"
        )
    if recorded_git.get("dirty"):
        out.append("the run had uncommitted changes (restored in the archived source)")
    if now.get("dirty"):
        out.append(f"this checkout has uncommitted changes ({len(diff.splitlines())} diff lines)")
    return out


def not_comparable_reasons(record: dict) -> list[str]:
    reasons = []
    level = (record.get("repro") or {}).get("level")
    if level == "fast":
        reasons.append("repro level 'fast': seeds only, identical bits are not promised")
    if record.get("nondeterministic_ops"):
        ops = ", ".join(record["nondeterministic_ops"][:3])
        reasons.append(f"the run recorded nondeterministic ops ({ops})")
    return reasons


def tolerance_report(metric_diffs: dict, tolerance: float) -> tuple[list[str], bool]:
    """Lines for each differing metric, and whether all acc/loss metrics are within."""
    lines, within = [], True
    for epoch, diffs in sorted(metric_diffs.items()):
        parts = []
        for key, (a, b) in diffs.items():
            judged = key.endswith(("_acc", "_loss"))
            if judged and isinstance(a, (int, float)) and isinstance(b, (int, float)):
                delta = abs(a - b)
                ok = math.isfinite(delta) and delta <= tolerance
                within &= ok
                parts.append(f"{key} {a:.6g} vs {b:.6g} (|d|={delta:.3g}, {'ok' if ok else 'OUT'})")
            else:
                parts.append(f"{key} {a} vs {b}")
        lines.append(f"  epoch {epoch}: " + "; ".join(parts))
    return lines, within


# ----------------------------------------------------------------------------- the re-run


def _override_value(value: str) -> str:
    if re.fullmatch(r"[\w./:+-]+", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def rerun_command(
    source: Path, config_dir: Path, run_dir: Path, record: dict, cfg, epochs: int | None
) -> list[str]:
    overrides = [f"hydra.run.dir={_override_value(str(run_dir))}"]
    seeds = record.get("seeds") or {}
    if seeds.get("source") == "entropy":
        overrides.append(f"seed.base={int(seeds['base'])}")
    if cfg.dataset.name == "cifar10":
        root = current_data_dir(str(cfg.dataset.root))
        overrides.append(f"dataset.root={_override_value(str(root))}")
    if epochs is not None:
        overrides.append(f"trainer.stop_after_epoch={epochs}")
    return [
        sys.executable, "-m", "reprotrain.train",
        f"--config-path={config_dir}", f"--config-name={PRIMARY}", *overrides,
    ]  # fmt: skip


def rerun_env(source: Path, record: dict) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(source / "src")  # replaces, never extends: no other reprotrain
    env["PYTHONHASHSEED"] = str((record.get("repro") or {}).get("pythonhashseed") or "0")
    recorded_vars = (record.get("environment") or {}).get("env") or {}
    if "CUBLAS_WORKSPACE_CONFIG" in recorded_vars:
        env["CUBLAS_WORKSPACE_CONFIG"] = recorded_vars["CUBLAS_WORKSPACE_CONFIG"]
    # The snapshot is not a checkout: keep git from finding an enclosing repo's HEAD.
    env["GIT_CEILING_DIRECTORIES"] = str(source.resolve().parent)
    return env


def imported_from(source: Path, env: dict[str, str]) -> Path:
    """Where ``import reprotrain`` resolves for the re-run (must be inside the snapshot)."""
    out = subprocess.run(
        [sys.executable, "-c", "import reprotrain; print(reprotrain.__file__)"],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise Refusal(f"the archived source does not import: {out.stderr.strip()[-200:]}")
    return Path(out.stdout.strip()).resolve()


def _current_preview(record: dict, cfg, rerun_vars: dict[str, str]) -> dict:
    """What this machine would record, before the re-run (the re-run's run.json decides)."""
    import torch

    dev = ((record.get("environment") or {}).get("device") or {}).get("type", "cpu")
    device = torch.device("cuda" if dev == "cuda" and torch.cuda.is_available() else "cpu")
    env = environment.capture(device)
    env["num_threads"] = int(cfg.repro.num_threads)  # the trainer sets it from the config
    env["env"] = {k: rerun_vars[k] for k in environment.ENV_ALLOWLIST if k in rerun_vars}
    return {"environment": env, "lock_sha256": lockfile.lock_sha256(REPO_ROOT)}


# ----------------------------------------------------------------------------- main


def reproduce(args: argparse.Namespace) -> int:
    archive = Path(args.archive).resolve()
    tmp_extract = args.extract_dir is None
    extract = (
        Path(tempfile.mkdtemp(prefix="reprotrain-reproduce-"))
        if tmp_extract
        else Path(args.extract_dir).resolve()
    )
    try:
        top = open_checked(archive, extract)
        print(f"archive  {archive}: manifest verified, extracted to {extract}")
        if args.verify_only:
            return EXIT_REPRODUCED
        return _replay(args, archive, top)
    finally:
        if tmp_extract:
            shutil.rmtree(extract, ignore_errors=True)


def _replay(args: argparse.Namespace, archive: Path, top: Path) -> int:
    run, source = top / "run", top / "source"
    record = json.loads((run / RUN_JSON).read_text())
    cfg = OmegaConf.load(run / RESOLVED_CONFIG)
    completed = int(record.get("epochs_completed") or 0)
    if args.epochs is not None and not 1 <= args.epochs <= completed:
        raise Refusal(f"--epochs {args.epochs}: the archived run has {completed} epoch(s)")
    if not (source / "src" / "reprotrain").is_dir():
        raise Refusal("the archive has no source snapshot (source/src/reprotrain)")

    data_cfg = OmegaConf.merge(cfg.dataset, {})
    if cfg.dataset.name == "cifar10":
        data_cfg.root = str(current_data_dir(str(cfg.dataset.root)))
    data_problem = check_data(data_cfg, record.get("data_fingerprint"), args.allow_data_drift)
    print(f"run      {record.get('experiment_id')}  seeds base={record['seeds']['base']} "
          f"({record['seeds']['source']})  repro={record['repro']['level']}  "
          f"epochs={completed}")  # fmt: skip
    print(f"data     {'DIFFERS: ' + data_problem if data_problem else 'fingerprint matches'}")
    for line in code_differences(record.get("git") or {}) or ["this checkout: same commit, clean"]:
        print(f"code     {line}")
    print(f"code     re-run uses the archived source ({source})")
    env = rerun_env(source, record)
    blocking, info = environment_differences(record, _current_preview(record, cfg, env))
    for line in blocking + info:
        print(f"env      {line}")
    if not blocking:
        print("env      matches the recorded environment")

    stamp = f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    new_run = (Path(args.runs_dir) / stamp).resolve()
    config_dir = top / "rerun-config"
    atomic_write_text(
        config_dir / f"{PRIMARY}.yaml",
        "# Written by `make reproduce`: the archived config under the reprotrain schema.\n"
        "defaults:\n  - train_schema\n  - _self_\n\n" + (run / RESOLVED_CONFIG).read_text(),
    )
    where = imported_from(source, env)
    if not where.is_relative_to(source.resolve()):
        raise Refusal(f"the re-run would import reprotrain from {where}, not the archive")
    cmd = rerun_command(source, config_dir, new_run, record, cfg, args.epochs)
    print(f"re-run   PYTHONPATH={env['PYTHONPATH']} (cwd {source})")
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd, cwd=source, env=env)
    if rc != 0 or not (new_run / RUN_JSON).is_file():
        print(f"error: the re-run failed (exit {rc}); see {new_run}/train.log", file=sys.stderr)
        return EXIT_RERUN_FAILED

    new_record = json.loads((new_run / RUN_JSON).read_text())
    # Authoritative: what the re-run itself recorded, with this checkout's lock.
    current = {**new_record, "lock_sha256": lockfile.lock_sha256(REPO_ROOT)}
    blocking, info = environment_differences(record, current)
    reasons = [f"environment differs: {b}" for b in blocking] + not_comparable_reasons(record)
    if data_problem:
        reasons.append(data_problem)
    result = compare_runs(run, new_run, epochs=args.epochs)
    lines, within = tolerance_report(result.metric_diffs, args.tolerance)
    scope = f"epoch(s) 1-{result.epochs_compared}" + ("" if args.epochs else " + final weights")
    if reasons:
        code = EXIT_NOT_COMPARABLE
        bits = "bits match anyway" if result.identical else result.verdict()
        verdict = "NOT COMPARABLE: " + "; ".join(reasons)
        detail = [
            f"  ({bits}); metrics "
            + ("identical" if not lines else ("within" if within else "OUTSIDE"))
            + f" tolerance {args.tolerance} on *_acc/*_loss",
            *lines,
        ]
    elif result.identical:
        code = EXIT_REPRODUCED
        verdict = f"REPRODUCED (bitwise): {scope} match the archived run"
        detail = []
    else:
        code = EXIT_DIVERGED
        where = f"epoch {result.divergent_epoch}" if result.divergent_epoch else "final weights"
        if result.divergent_step is not None:
            where += f" (step {result.divergent_step})"
        verdict = f"DIVERGED at {where}: " + "; ".join(result.reasons)
        detail = [
            "  metric differences ("
            + ("within" if within else "OUTSIDE")
            + f" tolerance {args.tolerance}):",
            *(lines or ["  (none)"]),
        ]
    report = {
        "created_at": now_iso(),
        "archive": str(archive),
        "archived_experiment_id": record.get("experiment_id"),
        "archived_run": record.get("run_dir"),
        "epochs": args.epochs,
        "verdict": verdict,
        "exit_code": code,
        "environment_differences": blocking,
        "environment_notes": info,
        "data": data_problem,
        "metric_differences": {str(k): v for k, v in result.metric_diffs.items()},
        "tolerance": args.tolerance,
    }
    atomic_write_text(new_run / REPORT, json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"new run  {new_run}")
    for line in detail:
        print(line)
    print(verdict)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reprotrain.tools.reproduce", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("archive", type=Path)
    p.add_argument("--epochs", type=int, default=None, help="compare only the first N epochs")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    p.add_argument("--allow-data-drift", action="store_true")
    p.add_argument("--runs-dir", type=Path, default=Path("outputs") / "reproduce")
    p.add_argument("--extract-dir", type=Path, default=None, help="keep the extracted archive")
    p.add_argument("--verify-only", action="store_true", help="check and extract, no re-run")
    args = p.parse_args(argv)
    try:
        return reproduce(args)
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
