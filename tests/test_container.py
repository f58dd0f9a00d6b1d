"""The container, built and run by a real engine (docs/container.md, issue 57).

Default tier: the Make targets drive Docker or Podman (fakes on PATH log each call: the
commands really run), the Debian base script, and what a run records of its container.
Slow tier: a real build on a real engine (podman here), the smoke job inside against the same
job outside, twice, a named subset of the default tier inside, and the lock installed offline
with hashes, a tampered hash refused. Those skip, saying so, only where no engine is installed
(.ci/run runs them in its slow tier where podman is installed).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, TINY, assert_ok, base_env, run_json, tool, train
from reprotrain.repro import comparability, environment
from reprotrain.repro.lock_platforms import SDIST_ONLY

MAKE = shutil.which("make")
needs_make = pytest.mark.skipif(MAKE is None, reason="needs make")


def fake(bin_dir: Path, name: str, body: str = "") -> Path:
    """An executable ``name`` that logs its argv (one JSON list a line), then runs ``body``."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir / f"{name}.log"
    path = bin_dir / name
    logger = f"{shlex.quote(sys.executable)} -c 'import json,sys; print(json.dumps(sys.argv[1:]))'"
    path.write_text(f'#!/bin/sh\n{logger} "$@" >> {shlex.quote(str(log))}\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return log


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def calls(log: Path) -> list[list[str]]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def make(bin_dir: Path, *args: str, dry: bool = False, **env: str) -> subprocess.CompletedProcess:
    """make in the repository with ``bin_dir`` first on PATH (its fakes shadow real engines)."""
    environ = {k: v for k, v in base_env().items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    environ.pop("PIP_CERT", None)
    environ.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env)
    cmd = [MAKE, "-s", "--no-print-directory", *(["-n"] if dry else []), *args]
    return subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=120)


NO_DAEMON = 'if [ "$1" = info ]; then echo "Cannot connect to the Docker daemon" >&2; exit 1; fi'


# ------------------------------------------------------------------ point 1: the Make targets


@needs_make
def test_the_engine_is_docker_with_a_daemon_else_podman_or_engine_and_the_choice_is_printed(
    tmp_path,
):
    bins = tmp_path / "bin"
    docker, podman = fake(bins, "docker", NO_DAEMON), fake(bins, "podman")
    proc = make(bins, "docker-build", "IMAGE=reprotrain:t")
    assert_ok(proc)
    assert proc.stdout.splitlines()[1].startswith("engine: podman (ENGINE unset: docker if its")
    assert [c[0] for c in calls(podman)] == ["image", "build"] and calls(docker) == [["info"]]

    fake(bins, "docker")  # now its daemon answers: docker is chosen
    docker.unlink()
    proc = make(bins, "docker-build", "IMAGE=reprotrain:t")
    assert "engine: docker (ENGINE unset" in proc.stdout and calls(docker)[-1][0] == "build"

    podman.unlink()
    proc = make(bins, "docker-build", "IMAGE=reprotrain:t", "ENGINE=podman")
    assert "engine: podman (ENGINE=podman)" in proc.stdout and calls(podman)[-1][0] == "build"

    for bad in ("lxc", "podman docker", "/usr/bin/podman", "$(shell id)"):
        proc = make(bins, "docker-build", f"ENGINE={bad}")
        assert proc.returncode == 2, proc.stdout
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert errors == [f"error: ENGINE={bad}: write ENGINE=docker or ENGINE=podman"]


@needs_make
def test_the_pinned_base_is_the_default_and_base_ref_builds_on_a_local_image(tmp_path):
    bins = tmp_path / "bin"
    image_id = "ab" * 32
    podman = fake(bins, "podman", f'[ "$1" = image ] && echo {image_id}; exit 0')
    proc = make(bins, "docker-build", "ENGINE=podman", "IMAGE=reprotrain:t")
    assert_ok(proc)
    pinned = (REPO / "docker" / "base-image.env").read_text()
    build = calls(podman)[-1]
    assert f"BASE_REF={pinned.split('BASE_IMAGE=')[1].split()[0]}" in build
    assert "not pinned by digest" in proc.stdout or "base: " in proc.stdout

    ca = tmp_path / "my ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    base = "localhost/reprotrain-base:bookworm"
    proc = make(bins, "docker-build", "ENGINE=podman", "IMAGE=x:1", f"BASE_REF={base}",
                f"CA_BUNDLE={ca}")  # fmt: skip
    assert_ok(proc)
    inspect, build = calls(podman)[-2:]
    assert inspect == ["image", "inspect", "--format", "{{.Id}}", base]
    assert f"BASE_REF={base}" in build and f"BASE_ID={image_id}" in build
    assert option(build, "--secret") == f"id=ca_bundle,src={ca}"  # a secret, not in a layer
    assert option(build, "--target") == "runtime" and option(build, "-t") == "x:1"
    assert "not pinned" not in proc.stdout and f"base: {base}" in proc.stdout


@needs_make
def test_docker_base_builds_a_debian_rootfs_with_mmdebstrap_and_imports_it(tmp_path):
    bins = tmp_path / "bin"
    mmdebstrap = fake(bins, "mmdebstrap", 'for a; do last2=$prev; prev=$a; done; : > "$last2"')
    podman = fake(bins, "podman")
    proc = make(bins, "docker-base", "ENGINE=podman", "DEBIAN_MIRROR=http://mirror.example/debian")
    assert_ok(proc)
    (debootstrap,) = calls(mmdebstrap)
    assert debootstrap[:4] == ["--quiet", "--variant=apt",
                               "--include=python3,python3-venv,ca-certificates,make,git",
                               "bookworm"]  # fmt: skip
    assert debootstrap[5] == "http://mirror.example/debian"
    (imported,) = calls(podman)
    assert imported[0] == "import" and imported[-1] == "localhost/reprotrain-base:bookworm"
    assert imported[-2] == debootstrap[4] and not Path(debootstrap[4]).exists()  # cleaned up
    assert "make docker-build BASE_REF=localhost/reprotrain-base:bookworm" in proc.stdout


@needs_make
def test_docker_train_and_test_give_the_run_its_image_id_and_engine(tmp_path):
    bins = tmp_path / "bin"
    podman = fake(bins, "podman", '[ "$1" = image ] && echo 0123; [ "$1" = --version ] && '
                  'echo "podman version 9.9"; exit 0')  # fmt: skip
    assert_ok(make(bins, "docker-train", "ENGINE=podman", "IMAGE=reprotrain:t",
                   "ARGS=experiment=smoke name='a b'"))  # fmt: skip
    run = calls(podman)[-1]
    assert run[:2] == ["run", "--rm"]
    assert run[-3:] == ["reprotrain:t", "experiment=smoke", "name=a b"]
    assert "REPROTRAIN_IMAGE_ID=0123" in run and "REPROTRAIN_ENGINE=podman version 9.9" in run
    assert_ok(make(bins, "docker-test", "ENGINE=podman", "IMAGE=reprotrain:t", "ARGS=-x t/a.py"))
    build, run = [c for c in calls(podman) if c[0] in ("build", "run")][-2:]
    assert option(build, "--target") == "test"
    assert run[-3:] == ["reprotrain:t-test", "-x", "t/a.py"]


def test_the_dockerfile_serves_both_the_official_and_the_debian_python():
    """Debian's base has ``python3`` only (in /usr/bin), the official image both (in
    /usr/local/bin): nothing runs ``python`` before /opt/venv (first on PATH) exists."""
    text = (REPO / "Dockerfile").read_text()
    script = (REPO / "docker" / "pip-lock.sh").read_text()
    assert 'python3 -m venv "$venv"' in script and '"$venv/bin/python" -m pip' in script
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert runs and not [r for r in runs if " python " in f" {r} "], runs
    assert "python -m pip" not in script.replace('"$venv/bin/python" -m pip', "")


# ------------------------------------------------------------------ point 3: the record


def test_container_image_names_image_engine_and_base_or_says_why_not(monkeypatch, tmp_path):
    for name in ("IMAGE", "IMAGE_ID", "ENGINE", "BASE_IMAGE", "BASE_ID", "GIT_COMMIT"):
        monkeypatch.delenv(f"REPROTRAIN_{name}", raising=False)
    marker = tmp_path / ".containerenv"
    monkeypatch.setattr(environment, "_ENGINE_MARKERS", ((str(marker), "podman"),))
    assert environment.container_image() is None  # outside any container

    marker.write_text("")  # a container someone else built: the engine says so, little else
    got = environment.container_image()
    assert got["engine"] == "podman" and got["image"] is None
    assert set(got["not_recorded"]) == {"image", "image_id", "base_id"}

    monkeypatch.setenv("REPROTRAIN_IMAGE", "reprotrain:abc-123")
    monkeypatch.setenv("REPROTRAIN_IMAGE_ID", "f" * 64)  # podman's form
    monkeypatch.setenv("REPROTRAIN_ENGINE", "podman version 4.3.1")
    monkeypatch.setenv("REPROTRAIN_BASE_IMAGE", "localhost/reprotrain-base:bookworm")
    monkeypatch.setenv("REPROTRAIN_BASE_ID", "sha256:" + "e" * 64)  # docker's form
    monkeypatch.setenv("REPROTRAIN_GIT_COMMIT", "c2c9eda")
    assert environment.container_image() == {
        "image": "reprotrain:abc-123",
        "image_id": "sha256:" + "f" * 64,
        "engine": "podman version 4.3.1",
        "base": "localhost/reprotrain-base:bookworm",
        "base_id": "sha256:" + "e" * 64,
        "git_commit": "c2c9eda",
        "not_recorded": {},
    }


def test_a_run_in_a_container_records_its_image_engine_and_base(tmp_path):
    env = base_env(REPROTRAIN_IMAGE="reprotrain:t", REPROTRAIN_IMAGE_ID="a" * 64,
                   REPROTRAIN_ENGINE="docker", REPROTRAIN_BASE_IMAGE="debian-base",
                   REPROTRAIN_BASE_ID="b" * 64)  # fmt: skip
    assert_ok(train(tmp_path / "run", *TINY, env=env))
    got = run_json(tmp_path / "run")["container"]
    assert got["image"] == "reprotrain:t" and got["image_id"] == "sha256:" + "a" * 64
    assert got["engine"] == "docker" and got["base"] == "debian-base"
    assert got["base_id"] == "sha256:" + "b" * 64 and got["not_recorded"] == {}


def _box(base: str | None, base_id: str | None) -> dict:
    return {"image": "reprotrain:t", "base": base, "base_id": base_id}


def test_runs_on_different_container_bases_are_not_promised_the_same_bits():
    debian, official = _box("debian", "sha256:" + "d" * 64), _box("python", "sha256:" + "p" * 64)
    same = {"container": debian}
    assert comparability.container_differences(same, {"container": dict(debian)}) == []
    (line,) = comparability.container_differences(same, {"container": official})
    assert line.startswith("container base: debian (sha256:ddd") and "-> python (sha256:ppp" in line
    (line,) = comparability.container_differences(same, {"container": None})
    assert "-> none (not in a container)" in line
    assert comparability.container_differences({"container": None}, {"container": None}) == []
    unpinned = {"container": _box("python:3.11-slim", None)}
    assert comparability.container_differences(unpinned, unpinned)  # the tag may have moved
    assert comparability.container_differences({}, same) == []  # recorded before containers
    # the rule for identical bits is unchanged: a different base alone blocks nothing there
    env = {"python": "3.11.2"}
    assert comparability.differences(env, env) == comparability.differences(env, dict(env))


def test_reproduce_of_a_containerised_run_names_the_image_to_use():
    assert environment.container_line(None) is None
    box = {**_box("localhost/reprotrain-base:bookworm", "sha256:" + "b" * 64),
           "image_id": "sha256:" + "a" * 64, "engine": "podman version 4.3.1",
           "git_commit": "c2c9eda"}  # fmt: skip
    line = environment.container_line(box)
    assert "container image reprotrain:t (ID sha256:aaa" in line and "podman version 4.3.1" in line
    assert line.endswith(
        "reproduce inside that image, or one built at commit c2c9eda by "
        "`make docker-build BASE_REF=localhost/reprotrain-base:bookworm`"
    )
    partial = environment.container_line({"engine": "docker"})
    assert "container image not recorded (ID not recorded, engine docker)" in partial


def test_reproduce_of_a_containerised_run_names_its_image_and_base_and_bits_decide(tmp_path):
    """reproduce of a run recorded in a container (the REPROTRAIN_* an image sets), re-run
    outside one: it names the image to use and the base difference, and since the bits agree
    the base is no reason (REPRODUCED)."""
    env = base_env(REPROTRAIN_IMAGE="reprotrain:t", REPROTRAIN_IMAGE_ID="a" * 64,
                   REPROTRAIN_ENGINE="podman version 4.3.1", REPROTRAIN_BASE_IMAGE="debian-base",
                   REPROTRAIN_BASE_ID="b" * 64, REPROTRAIN_GIT_COMMIT="c2c9eda")  # fmt: skip
    assert_ok(train(tmp_path / "run", *TINY, env=env))
    assert_ok(tool("archive.archive", str(tmp_path / "run"), "--out-dir", str(tmp_path / "a")))
    (archive,) = (tmp_path / "a").glob("*.tar.gz")
    proc = tool("reproduce.reproduce", str(archive), "--trust", "--runs-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "image    the run ran in container image reprotrain:t (ID sha256:aaa" in proc.stdout
    assert "`make docker-build BASE_REF=debian-base`" in proc.stdout
    assert "env      container base: debian-base (sha256:bbb" in proc.stdout
    assert "not promised the same bits" in proc.stdout  # here: no container, or another
    assert proc.stdout.strip().splitlines()[-1].startswith("REPRODUCED (bitwise)")


# ------------------------------------------------------------------ point 2: a real engine


def _engine() -> str | None:
    """The engine the Makefile would pick that really works here, or None."""
    for name, probe in (("docker", ["docker", "info"]), ("podman", ["podman", "info"])):
        if shutil.which(name) and subprocess.run(probe, capture_output=True).returncode == 0:
            return name
    return None


#: A named subset of the default tier run inside the test image (under 5 minutes on 2 cores):
#: the Dockerfile and lock checks, the Make variables, comparability and environment records,
#: and the reference job's pinned hashes.
INSIDE = [
    "tests/test_docker.py",
    "tests/test_make_variables.py",
    "tests/test_comparability.py",
    "tests/test_environment.py",
    "tests/starter/test_reference_job.py::test_micro_smoke_bits_are_pinned_and_one_microbatch_keeps_them",
]


@pytest.fixture(scope="module")
def image():
    """The runtime and test images, built by the Make targets on a local Debian base
    (``make docker-base``) unless BASE_REF names another; their tag."""
    engine = _engine()
    if engine is None:
        pytest.skip("needs podman or docker (with a daemon): no container engine here")
    env = {k: v for k, v in base_env().items() if k not in ("MAKEFLAGS", "MAKELEVEL")}
    base = os.environ.get("BASE_REF") or "localhost/reprotrain-base:bookworm"
    have = subprocess.run([engine, "image", "inspect", base], capture_output=True)
    if have.returncode != 0:
        assert_ok(subprocess.run([MAKE, "docker-base", f"BASE_NAME={base}"], cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=1800))  # fmt: skip
    tag = f"reprotrain:slowtest-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    for target in ("docker-build", "docker-test"):  # docker-test: builds, then a quick run
        args = [target, f"BASE_REF={base}", f"IMAGE={tag}"]
        proc = subprocess.run([MAKE, *args, "ARGS=--co -q tests/test_docker.py"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=3600)  # fmt: skip
        assert_ok(proc)
    print(f"built {tag} on {base} in {time.monotonic() - start:.0f} s")
    yield {"engine": engine, "tag": tag, "base": base, "env": env}
    subprocess.run([engine, "rmi", tag, f"{tag}-test"], capture_output=True)


def _inside(engine: str, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    """``<engine> run --rm --network none [-v out:/app/outputs/t] ARGS``: nothing reached."""
    cmd = [engine, "run", "--rm", "--network", "none"]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        out.chmod(0o777)  # the test image runs as uid 1000
        cmd += ["-v", f"{out}:/app/outputs/t"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=1800)


@pytest.mark.slow
def test_a_smoke_run_inside_the_image_equals_the_same_run_outside_and_repeats(image, tmp_path):
    """`make docker-train` twice and `make train` inside the test image give the bits of the
    same config trained outside on this machine (another Python build inside: Debian's 3.11.2;
    the same glibc 2.36 and oneDNN dispatch here); each run records the image, its ID, the
    engine and the base. The seconds each took are printed (docs/container.md)."""
    smoke, name, times = "experiment=smoke", f"ctest-{uuid.uuid4().hex[:8]}", {}
    try:
        for i in (1, 2):  # the runtime image, as users run it
            start = time.monotonic()
            args = [f"IMAGE={image['tag']}", f"ARGS={smoke} hydra.run.dir=/app/outputs/{name}/{i}"]
            proc = subprocess.run([MAKE, "docker-train", *args], cwd=REPO, env=image["env"],
                                  capture_output=True, text=True, timeout=1800)  # fmt: skip
            times[f"docker-train {i}"] = time.monotonic() - start
            assert_ok(proc)
        inside = [run_json(REPO / "outputs" / name / str(i)) for i in (1, 2)]
    finally:
        shutil.rmtree(REPO / "outputs" / name, ignore_errors=True)
    start = time.monotonic()
    made = _inside(image["engine"], "--entrypoint", "make", f"{image['tag']}-test", "train",
                   f"ARGS={smoke} hydra.run.dir=/app/outputs/t/m", out=tmp_path / "m")  # fmt: skip
    times["make train in the test image"] = time.monotonic() - start
    assert_ok(made)
    start = time.monotonic()
    assert_ok(train(tmp_path / "host", smoke, micro=False, timeout=1800))
    times["make train outside"] = time.monotonic() - start
    print("smoke run seconds:", {k: round(v) for k, v in times.items()})
    outside, made = run_json(tmp_path / "host"), run_json(tmp_path / "m" / "m")
    why = comparability.differences(outside["environment"], inside[0]["environment"])
    why += comparability.container_differences(outside, inside[0])
    weights = {r["final_weights_sha256"] for r in (*inside, made, outside)}
    assert len(weights) == 1, f"inside != outside; the environments differ in: {why}"
    inspect = [image["engine"], "image", "inspect", "--format", "{{.Id}}", image["tag"]]
    image_id = subprocess.run(inspect, capture_output=True, text=True).stdout.strip()
    box = inside[0]["container"]
    assert box["image"] == image["tag"] and box["image_id"].endswith(image_id)
    assert box["engine"].startswith(image["engine"]) and box["base"] == image["base"]
    assert box["base_id"].startswith("sha256:") and box["not_recorded"] == {}
    assert made["container"]["image"] == f"{image['tag']}-test"
    assert (outside["container"] or {}).get("image") is None  # this host: not in our image


@pytest.mark.slow
def test_a_named_subset_of_the_default_tier_passes_inside_in_under_five_minutes(image):
    start = time.monotonic()
    proc = _inside(image["engine"], f"{image['tag']}-test", "-m", "not slow", *INSIDE)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert took < 300, f"{took:.0f} s"
    print(f"inside: {proc.stdout.strip().splitlines()[-1]} in {took:.0f} s")


@pytest.mark.slow
def test_the_lock_installs_offline_with_hashes_and_a_tampered_hash_is_refused(image, tmp_path):
    """The builders run docker/pip-lock.sh: download the lock's files from the package
    registry (the only network use), then install from them alone. Here the same script, in the
    image, downloads into build/wheels (kept between runs: a file already there is
    hash-checked, not fetched again), then with no network at all checks every file of the lock
    against its hash and resolves the install (pip --dry-run), and refuses a lock with one hash
    changed."""
    wheels = REPO / "build" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    script, lock = "/build/pip-lock.sh", "/build/requirements.lock"
    sdist = ",".join(sorted(SDIST_ONLY))  # what the Dockerfile passes as SDIST_ONLY
    mounts = ["-v", f"{wheels}:/wheels", "-e", "VENV=/tmp/v", "-e", f"SDIST_ONLY={sdist}"]
    mounts += ["--entrypoint", "sh"]
    ca = os.environ.get("PIP_CERT")  # pip's CA here (a TLS-inspecting proxy): as the build has it
    mounts += ["-v", f"{ca}:/run/secrets/ca_bundle:ro"] if ca else []
    test_image = f"{image['tag']}-test"
    fetch = subprocess.run([image["engine"], "run", "--rm", "--user", "0", *mounts, test_image,
                            script, "download", "/wheels", lock], capture_output=True,
                           text=True, timeout=3600)  # fmt: skip
    assert fetch.returncode == 0, fetch.stderr[-3000:]
    install = [*mounts, test_image, script, "install", "/wheels"]
    ok = _inside(image["engine"], *install, lock, "--", "--dry-run")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "Would install" in ok.stdout and "torch-2.14.1" in ok.stdout
    text = (REPO / "requirements.lock").read_text()
    good = text.split("\ntqdm==", 1)[1].split("--hash=sha256:", 2)[1][:64]
    (tmp_path / "bad.lock").write_text(text.replace(good, "0" * 64))
    tmp_path.chmod(0o755)  # pytest's folders are private; the image's user (uid 1000) reads it
    (tmp_path / "bad.lock").chmod(0o644)
    refused = _inside(image["engine"], "-v", f"{tmp_path}:/bad:ro", *install, "/bad/bad.lock",
                      "--", "--dry-run")  # fmt: skip
    assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr
