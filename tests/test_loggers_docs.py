"""The loggers' commands run as pasted (issue 46.6): the loggers page trains without a
download, the tools are typed with their venv path (or the page says to activate it), and
``mlflow ui --backend-store-uri sqlite:///mlruns.db`` (docs/loggers.md, conf/logger/mlflow.yaml)
starts from the locked extra and serves the store; it used to fail with "No module named
'flask'" (the extra locked mlflow-skinny, which has neither the server's packages nor the
UI's files)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, base_env
from reprotrain.repro.requirements_lock import parse_lock
from test_docs import split, tiny

LOGGERS = REPO / "docs" / "loggers.md"
PAGES = [LOGGERS, REPO / "docs" / "sweeps-optuna.md", REPO / "docs" / "seeing-a-run.md"]
TOOLS = ("tensorboard", "mlflow", "wandb", "reprotrain", "reprotrain-train")
ACTIVATE = ". .venv/bin/activate"
EXTRAS = "optional extra not installed: make install EXTRAS=mlflow,wandb"


def command_lines(page: Path) -> list[str]:
    """Every line of the page's bash blocks, less its trailing comment."""
    return [
        line.split("  #")[0].strip()
        for block in split(page)[1]
        if block.info in ("bash", "sh", "shell")
        for line in block.text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def make_lines(page: Path) -> list[str]:
    return [c for c in command_lines(page) if re.match(r"make (train|sweep)\b", c)]


def test_the_loggers_page_trains_on_synthetic_data_not_a_download() -> None:
    """Without ``experiment=smoke`` (or another experiment) a ``make train`` starts the
    default config's CIFAR-10 download."""
    lines = make_lines(LOGGERS)
    assert len(lines) >= 5, lines
    for line in lines:
        assert re.search(r'ARGS="[^"]*\bexperiment=\w+', line), line


def test_a_bare_tool_is_only_typed_where_the_page_says_to_activate_the_venv() -> None:
    for page in PAGES:
        bare = [c for c in command_lines(page) if c.split()[0] in TOOLS]
        if bare:
            assert ACTIVATE in page.read_text(), f"{page.name}: {bare[0]} needs {ACTIVATE}"
    for yaml_file in sorted((REPO / "conf" / "logger").glob("*.yaml")):
        for line in yaml_file.read_text().splitlines():
            said = line.lstrip("# ").split()
            if said and said[0] in TOOLS and len(said) > 1 and not said[1].endswith(":"):
                pytest.fail(f"{yaml_file.name}: {line.strip()} (type .venv/bin/{said[0]})")
    assert f"`{ACTIVATE}`" in LOGGERS.read_text()


def ui_line() -> str:
    """The page's one ``mlflow ui`` command; the logger's config file shows the same."""
    (line,) = [c for c in command_lines(LOGGERS) if " ui " in c and "mlflow" in c]
    assert f"#   {line}" in (REPO / "conf" / "logger" / "mlflow.yaml").read_text()
    return line


def test_the_mlflow_extra_locks_the_ui_the_page_starts() -> None:
    """The lock has the full mlflow package (its server needs flask, its page is in the
    package's files); installed from it, both are there."""
    assert ui_line().startswith(".venv/bin/mlflow ui ")
    lock = parse_lock(REPO / "requirements-mlflow.lock").entries
    assert {"mlflow", "flask"} <= set(lock) and lock["mlflow"].version == lock[
        "mlflow-skinny"
    ].version
    mlflow = pytest.importorskip("mlflow", reason=EXTRAS)
    assert importlib.util.find_spec("flask") is not None
    assert (Path(mlflow.__file__).parent / "server" / "js" / "build" / "index.html").is_file()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode(errors="replace")
    except OSError:
        return 0, ""


def poll(url: str, proc: subprocess.Popen, expected: str, seconds: float = 240) -> str:
    """The page at ``url`` once it holds ``expected`` (the server starts in about half a
    minute on an idle machine), or what it last said when the time is up."""
    deadline, body = time.monotonic() + seconds, ""
    while time.monotonic() < deadline and proc.poll() is None:
        status, body = get(url)
        if status == 200 and expected in body:
            break
        time.sleep(1)
    return body


@pytest.mark.slow
def test_the_mlflow_ui_line_starts_and_serves_the_projects_store(tmp_path: Path) -> None:
    """Pasted in a project root holding a store, on 127.0.0.1 and a free port: the page
    answers and its API lists the store's experiment; stopped within the test's bounds."""
    pytest.importorskip("mlflow", reason=EXTRAS)
    from reprotrain.loggers import LoggerConfig, build_loggers

    store = f"sqlite:///{tmp_path / 'mlruns.db'}"
    cfg = LoggerConfig(mlflow=True, mlflow_tracking_uri=store, mlflow_experiment="pasted")
    with build_loggers(cfg, tmp_path / "outputs" / "r", {"started_at": "r"}):
        pass
    port = free_port()
    venv_bin = f"{Path(sys.executable).parent}/"
    line = ui_line().replace(".venv/bin/", venv_bin) + f" --host 127.0.0.1 --port {port}"
    log = tmp_path / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=tmp_path, env=base_env(),
                                stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        page = poll(f"http://127.0.0.1:{port}/", proc, "<title>MLflow</title>")
        assert "<title>MLflow</title>" in page, (proc.poll(), log.read_text()[-3000:])
        api = f"http://127.0.0.1:{port}/ajax-api/2.0/mlflow/experiments/search?max_results=50"
        listed = poll(api, proc, '"pasted"')
        assert '"pasted"' in listed, (listed[:2000], log.read_text()[-3000:])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def kept_logger(line: str, run_dir: Path) -> str:
    """The docs test's tiny settings, but the logger the line chose (its MLflow store and
    W&B run in the test's folder, offline)."""
    small = tiny(line, run_dir)
    if "logger=" not in line.partition('ARGS="')[2].partition('"')[0]:
        return small
    return small.replace(
        " logger=none ",
        f" logger.mlflow_tracking_uri=sqlite:///{run_dir.parent}/mlruns.db "
        "logger.wandb_mode=offline ",
    )


@pytest.mark.slow
@pytest.mark.parametrize("line", [c for c in make_lines(LOGGERS) if c.startswith("make train")])
def test_the_loggers_pages_train_lines_run_as_pasted(line: str, tmp_path: Path) -> None:
    if "mlflow" in line or "wandb" in line:
        pytest.importorskip("mlflow", reason=EXTRAS)
        pytest.importorskip("wandb", reason=EXTRAS)
    command = kept_logger(line, tmp_path / "run")
    env = base_env(PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}",
                   HOME=str(tmp_path / "home"), WANDB_BASE_URL="http://127.0.0.1:9")  # fmt: skip
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "run" / "run.json").is_file()
