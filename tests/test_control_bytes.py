"""No error path writes a raw control byte to the terminal (issue 52, point 5).

ESC, CR, BEL, DEL and a C1 control (CSI, U+009B) fed to every entry point a user types, in an
override and in a path: each command fails in ``error:`` lines whose every control character
is shown escaped (``\\x1b``), and neither stdout nor stderr holds one raw. Was: a Hydra
override parse error echoed the override raw (``trainer.epochs=[ESC[31m`` coloured the
terminal). A NUL cannot reach a command through argv (the kernel's exec takes C strings);
in a config value that names a path it is refused (tests/test_run_paths.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_env
from test_bad_inputs import run_in_process

CONTROL = "\x1b[31m\rX\x07\x7f\u009b"
RAW = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")  # tab and newline allowed


def _run_dir(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"status": "completed", "seeds": {"base": 1}}))
    (run / "config.resolved.yaml").write_text("trainer: {epochs: 1}\n")
    return run


COMMANDS = {
    "train-override": lambda d: ["reprotrain.train", "experiment=selfcheck",
                                 f"trainer.epochs=[{CONTROL}", f"hydra.run.dir={d / 'new'}"],
    "train-key": lambda d: ["reprotrain.train", "experiment=selfcheck", f"{CONTROL}=1",
                            f"hydra.run.dir={d / 'new'}"],
    "train-resume-path": lambda d: ["reprotrain.train", "experiment=selfcheck",
                                    f"resume={d / CONTROL}", f"hydra.run.dir={d / 'new'}"],
    "resume-override": lambda d: ["reprotrain.tools.runs.resume", str(_run_dir(d)),
                                  f"trainer.epochs=[{CONTROL}"],
    "resume-path": lambda d: ["reprotrain.tools.runs.resume", str(d / CONTROL)],
    "eval-override": lambda d: ["reprotrain.tools.runs.eval", str(_run_dir(d)), f"{CONTROL}=1"],
    "eval-checkpoint": lambda d: ["reprotrain.tools.runs.eval", str(_run_dir(d)),
                                  "--checkpoint", str(d / CONTROL)],
    "archive-path": lambda d: ["reprotrain.tools.archive.archive", str(d / CONTROL)],
    "archive-out-dir": lambda d: ["reprotrain.tools.archive.archive", str(_run_dir(d)),
                                  "--out-dir", str(d / CONTROL)],
    "reproduce-path": lambda d: ["reprotrain.tools.reproduce.reproduce", str(d / f"{CONTROL}.tgz")],
}  # fmt: skip


#: Commands whose error comes from a trainer they start: run as a process of their own.
CHILD_PROCESS = {"resume-override"}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_control_bytes_in_an_override_or_a_path_are_shown_escaped_never_raw(tmp_path, command):
    """Each command in this interpreter (its ``__main__``, the trainer's preflight); one
    that starts the trainer as a child (resume) in a process of its own, bytes as written."""
    argv = [sys.executable, "-m", *COMMANDS[command](tmp_path)]
    if command in CHILD_PROCESS:
        proc = subprocess.run(argv, cwd=REPO, env=base_env(), capture_output=True, timeout=300)
        code = proc.returncode
        out, err = (b.decode(errors="surrogateescape") for b in (proc.stdout, proc.stderr))
    else:
        code, out, err = run_in_process(argv)
    text = (out + err).encode("utf-8", "surrogateescape")
    assert code == 2 and "Traceback" not in err and "\nerror: " in "\n" + err, out + err
    assert RAW.search(text) is None, f"a raw control byte: {text[-3000:]!r}"


def test_a_hydra_parse_error_reaches_the_terminal_escaped_end_to_end(tmp_path):
    """The reported case, as typed: a fresh trainer process, its bytes on stderr."""
    argv = [sys.executable, "-m", *COMMANDS["train-override"](tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=base_env(), capture_output=True, timeout=300)
    assert proc.returncode == 2 and RAW.search(proc.stdout + proc.stderr) is None, proc.stderr
    assert proc.stderr.startswith(b"error: ") and b"\\x1b[31m" in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()
