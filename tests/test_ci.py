"""CI runs what the README says, first: `.ci/run` opens with the README's two commands,
exactly as written, before it installs anything; what `make test` skipped for a missing
extra or binary is listed, and run again once CI has installed it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO
from test_test_policy import inner_pytest


def readme_two_commands() -> list[str]:
    """The lines of the first two blocks of the README's "Two commands", without comments."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:2]
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def ci_commands() -> list[str]:
    """.ci/run's command lines, comments and blank lines left out, in order."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    out = [line.split(" #", 1)[0].strip() for line in lines if not line.lstrip().startswith("#")]
    return [line for line in out if line and not line.startswith(("set -", 'cd "$(dirname'))]


def test_ci_opens_with_the_readmes_two_commands_exactly_and_installs_nothing_before():
    readme = readme_two_commands()
    assert readme == ['make train ARGS="experiment=smoke"', "make test"]
    assert ci_commands()[:2] == readme
    assert (REPO / ".ci" / "run").read_text().startswith("#!/usr/bin/env bash\n")


def test_ci_installs_the_extras_then_runs_what_make_test_skipped_for_them():
    commands = ci_commands()
    installs = [i for i, c in enumerate(commands) if "EXTRAS=" in c or "apt_install" in c]
    assert installs and min(installs) > 1
    extras = max(i for i in installs if "EXTRAS=" in commands[i])
    assert commands.index("make test-skipped") > extras
    assert commands.index("make test-slow") == len(commands) - 1


def test_make_test_prints_the_15_slowest_and_lists_what_it_skipped_for_an_install():
    recipe = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    assert "--durations=15" in recipe
    assert "--skipped-to=build/tests/skipped-for-installs.txt" in recipe


def test_the_tests_skipped_for_an_extra_or_a_binary_are_listed_and_run_again(tmp_path):
    source = """
        import pytest

        def test_extra():
            pytest.importorskip("reprotrain_no_extra", reason="optional extra not installed: x")

        def test_binary():
            pytest.skip("qemu-x86_64 not on PATH")

        def test_device():
            pytest.skip("needs a CUDA device")

        def test_runs():
            pass
        """
    listed = tmp_path / "out" / "skipped.txt"
    proc = inner_pytest(tmp_path, source, f"--skipped-to={listed}")
    assert proc.returncode == 0, proc.stdout
    assert listed.read_text().splitlines() == [
        "test_inner.py::test_binary", "test_inner.py::test_extra",
    ]  # fmt: skip
    again = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-rA", f"@{listed}"], cwd=tmp_path, capture_output=True, text=True,
                           env=inner_env(), check=False)  # fmt: skip
    assert "2 skipped" in again.stdout and "test_device" not in again.stdout, again.stdout


def inner_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO / "src")]))


def _container_setup(tmp_path, docker_answers: bool, podman_answers: bool = True):
    """.ci/run's container block, run by bash with stub programs on an empty PATH: which it
    installs, and how it ends. ``apt_install`` puts a stub of each package on PATH; the
    engine settings are written under tmp_path, never to /etc."""
    text = (REPO / ".ci" / "run").read_text()
    block = text[text.index("# The container (docs/container.md)") : text.index("make test-slow")]
    conf = tmp_path / "containers.conf"
    block = block.replace("/etc/containers/containers.conf", str(conf))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("grep", "tee", "id", "chmod"):
        (bin_dir / tool).symlink_to(subprocess.check_output(["which", tool], text=True).strip())
    (bin_dir / "docker").write_text(f"#!/bin/sh\nexit {0 if docker_answers else 1}\n")
    (bin_dir / "docker").chmod(0o755)
    stub = f"#!/bin/sh\\nexit {0 if podman_answers else 125}\\n"
    script = (
        f'sudo=""\napt_install() {{ for p in "$@"; do echo "$p" >> {tmp_path}/installed; '
        f'printf "{stub}" > {bin_dir}/$p; chmod +x {bin_dir}/$p; done; }}\n{block}'
    )
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run(["/bin/bash", "-euo", "pipefail", "-c", script], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    done = tmp_path / "installed"
    installed = done.read_text().split() if done.exists() else []
    return proc, installed, conf


def test_ci_installs_podman_where_dockers_client_has_no_daemon_so_the_container_tests_run(
    tmp_path,
):
    """The last CI host had a Docker client without a daemon and no podman: the container
    tests skipped and the skip policy failed the slow tier. CI now installs the engine."""
    proc, installed, conf = _container_setup(tmp_path / "a", docker_answers=False)
    assert proc.returncode == 0, proc.stderr
    assert {"podman", "runc", "mmdebstrap"} <= set(installed)  # uidmap too where not root
    assert "default_ulimits = []" in conf.read_text()  # these VMs: docs/container.md
    proc, installed, _ = _container_setup(tmp_path / "b", docker_answers=True)
    assert proc.returncode == 0 and installed == ["mmdebstrap"], (proc.stderr, installed)
    proc, _, _ = _container_setup(tmp_path / "c", docker_answers=False, podman_answers=False)
    assert proc.returncode == 1 and "'podman info' fails" in proc.stderr
