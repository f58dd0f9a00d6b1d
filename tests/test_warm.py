"""The warm interpreter (tests/warm.py) gives what a fresh process gives: a command sent warm
and the same command started cold agree in bits, record, argv, paths, environment, exit
status and output, and each warm child draws fresh entropy, as a fresh process does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import warm
from conftest import MICRO, TINY, base_env, run_json

PROBE = """
import atexit, json, os, random, signal, sys, time
light = sys.argv[2:] == ["light"]  # a nested test's child: no torch to import when cold
if not light:
    import numpy, torch

main = sys.modules["__main__"]
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "env": {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "HOME", "PROBE_VALUE")},
    "main_file": getattr(main, "__file__", None), "mp_main": sys.modules.get("__mp_main__") is main,
    "hash": hash("reprotrain"), "ppid": os.getppid(),
    "entropy": [] if light else [random.random(), float(numpy.random.random()),
                                 torch.initial_seed()],
}))
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("unflushed tail")
how = sys.argv[1]
if how == "raise":
    raise ValueError("probe failed")
if how == "kill":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
if how == "sleep":
    time.sleep(60)
sys.exit(int(how))
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    (tmp_path / "reprotrain_probe.py").write_text(textwrap.dedent(PROBE))
    return tmp_path


def both(cwd: Path, *args: str, **env: str):
    """(warm, cold) results of ``python -m reprotrain_probe <args>``."""
    cmd = [sys.executable, "-m", "reprotrain_probe", *args]
    hot = warm.run_warm(cmd, cwd=cwd, env=base_env(**env), capture_output=True, text=True,
                        timeout=120)  # fmt: skip
    cold = warm.run_cold(cmd, cwd=cwd, env=base_env(**env), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return hot, cold


def facts(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.splitlines()[0])


def test_a_warm_child_has_a_fresh_processs_argv_paths_environment_and_main(probe):
    hot, cold = both(probe, "0", PROBE_VALUE="x y")
    a, b = facts(hot), facts(cold)
    entropy = a.pop("entropy"), b.pop("entropy")
    a.pop("ppid"), b.pop("ppid")
    assert a == b
    assert a["argv"] == [str(probe / "reprotrain_probe.py"), "0"] and a["mp_main"]
    assert a["env"]["PROBE_VALUE"] == "x y" and a["env"]["PYTHONHASHSEED"] == "0"
    assert len(set(entropy[0]) | set(entropy[1])) == 6


def test_two_warm_children_draw_different_entropy_as_fresh_processes_do(probe):
    cmd = [sys.executable, "-m", "reprotrain_probe", "0"]
    kw = {"cwd": probe, "env": base_env(), "capture_output": True, "text": True, "timeout": 120}
    first, second = (facts(warm.run_warm(cmd, **kw))["entropy"] for _ in range(2))
    assert all(x != y for x, y in zip(first, second, strict=True))


@pytest.mark.parametrize("how", ["0", "3", "raise", "kill"])
def test_exit_status_atexit_and_buffered_output_are_a_fresh_processs(probe, how):
    # torch imported in the fresh twin for a clean exit (its atexit hooks run too); the other
    # ways out compare with a twin that does not import it (2 s of CPU each, cold)
    hot, cold = both(probe, how) if how == "0" else both(probe, how, "light")
    assert hot.returncode == cold.returncode
    assert hot.stdout.splitlines()[1:] == cold.stdout.splitlines()[1:]
    assert hot.stderr.splitlines()[-1:] == cold.stderr.splitlines()[-1:]
    if how in ("0", "3"):
        assert hot.stdout.endswith("unflushed tailatexit ran\n")


NESTED = """
import json, os, signal, subprocess, sys, time
probe = [sys.executable, "-m", "reprotrain_probe"]
done = subprocess.run([*probe, "0", "light"], capture_output=True, text=True)
subprocess.run([*probe, "raise", "light"])  # the caller's own fds
grouped = subprocess.Popen([*probe, "sleep", "light"], stdout=subprocess.DEVNULL)
proc = subprocess.Popen([*probe, "sleep", "light"], start_new_session=True,
                        stdout=subprocess.DEVNULL)
time.sleep(1)
session = os.getsid(proc.pid) == proc.pid
same_group = os.getpgid(grouped.pid) == os.getpgid(0)
grouped.kill()
proc.send_signal(signal.SIGTERM)
print(json.dumps({"out": done.stdout.splitlines()[1:], "code": done.returncode,
                  "session": session, "same_group": same_group, "killed": proc.wait(),
                  "me": os.getpid(), "grouped_status": grouped.wait(),
                  "parent_of_child": json.loads(done.stdout.splitlines()[0]).get("ppid"),
                  "warm_started": type(proc).__name__ == "WarmPopen",
                  "grouped_warm": type(grouped).__name__ == "WarmPopen"}))
"""


LEADER = """
import json, os, subprocess, sys
child = subprocess.Popen([sys.executable, "-m", "reprotrain_probe", "0", "light"],
                         stdout=subprocess.PIPE, text=True)
out, _ = child.communicate()
print(json.dumps({"warm": type(child).__name__ == "WarmPopen", "me": os.getpid(),
                  "parent": json.loads(out.splitlines()[0])["ppid"]}))
"""


def test_a_warm_childs_own_commands_start_warm_and_behave_as_real_children(probe):
    """What the framework's launchers do (resume, verify run a trainer): ``subprocess.run``
    and ``Popen`` with or without a new session + a signal, in a warm child as in a cold one.
    One in a session of its own forks from the zygote. One in the caller's own process group
    (a ``killpg`` of the caller reaches it) forks from the zygote too while the caller is in
    the zygote's group (the fork is then in that group as well), and starts for real when
    the caller leads a group of its own (started in a new session)."""
    (probe / "reprotrain_nested.py").write_text(textwrap.dedent(NESTED))
    (probe / "reprotrain_leader.py").write_text(textwrap.dedent(LEADER))
    cmd = [sys.executable, "-m", "reprotrain_nested"]
    kw = {"cwd": probe, "env": base_env(), "capture_output": True, "text": True, "timeout": 120}
    procs = warm.run_warm(cmd, **kw), warm.run_cold(cmd, **kw)
    for proc in procs:  # the inherited stdout and stderr stay apart
        assert proc.stderr.rstrip().endswith("ValueError: probe failed"), proc.stderr
        assert "ValueError" not in proc.stdout
    hot, cold = (json.loads(p.stdout.splitlines()[-1]) for p in procs)
    assert hot["out"] == cold["out"] == ["unflushed tailatexit ran"]
    assert hot["code"] == cold["code"] == 0
    assert hot["session"] and cold["session"]
    assert hot["same_group"] and cold["same_group"]
    assert hot["killed"] == cold["killed"] == -15
    assert hot["grouped_status"] == cold["grouped_status"] == -9
    assert hot["warm_started"] and not cold["warm_started"], "the session's command was cold"
    assert hot["grouped_warm"] and not cold["grouped_warm"]
    # A real fork's parent is its caller; a warm one's is the zygote (torchrun's workers
    # read it, and they never start warm: tests/warm.py).
    assert cold["parent_of_child"] == cold["me"] and hot["parent_of_child"] != hot["me"]
    leads = warm.run_warm([sys.executable, "-m", "reprotrain_leader"], start_new_session=True,
                          **kw)  # fmt: skip
    leader = json.loads(leads.stdout.splitlines()[-1])
    assert not leader["warm"] and leader["parent"] == leader["me"], "its group: a real fork"


def test_a_timeout_kills_the_warm_child_and_raises_as_subprocess_does(probe):
    cmd = [sys.executable, "-m", "reprotrain_probe", "sleep"]
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run_warm(cmd, cwd=probe, env=base_env(), capture_output=True, timeout=1)


def test_only_commands_that_start_alike_share_a_zygote():
    env = base_env()
    assert warm.signature(dict(env, HOME="/elsewhere")) == warm.signature(env)
    for name, value in (("LC_ALL", "C"), ("PYTHONPATH", "/x"), ("OMP_NUM_THREADS", "1"),
                        ("MKL_CBWR", "COMPATIBLE"), ("TMPDIR", "/x")):  # fmt: skip
        assert warm.signature(dict(env, **{name: value})) != warm.signature(env), name
    assert warm.signature({k: v for k, v in env.items() if k != "PYTHONHASHSEED"}) is None
    python = sys.executable
    assert warm.warm_command([python, "-m", "reprotrain.train"], {}) is not None
    for args, kw in (([python, "-X", "dev", "-m", "reprotrain.train"], {}),
                     ([python, "-m", "pip", "list"], {}),
                     ([python, "-m", "reprotrain.train"], {"stdin": subprocess.PIPE}),
                     ([python, "-m", "reprotrain.train"], {"preexec_fn": print}),
                     (["python3", "-m", "reprotrain.train"], {})):  # fmt: skip
        assert warm.warm_command(args, kw) is None, args


def test_a_trainer_run_warm_and_cold_gives_the_same_bits_and_record(tmp_path):
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, *TINY]
    for name, runner in (("warm", warm.run_warm), ("cold", warm.run_cold)):
        proc = runner([*cmd, f"hydra.run.dir={tmp_path / name}"], env=base_env(),
                      capture_output=True, text=True, timeout=240)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
    hot, cold = run_json(tmp_path / "warm"), run_json(tmp_path / "cold")
    differ = {k for k in hot.keys() | cold.keys() if hot.get(k) != cold.get(k)}
    assert differ <= {"run_dir", "command", "started_at", "finished_at"}, differ
    assert hot["final_weights_sha256"] == cold["final_weights_sha256"]
    for name in ("metrics.jsonl",):
        lines = [(tmp_path / n / name).read_text().splitlines() for n in ("warm", "cold")]
        strip = [[{k: v for k, v in json.loads(x).items() if k not in ("seconds", "images_per_s")}
                  for x in side] for side in lines]  # fmt: skip
        assert strip[0] == strip[1]


def test_cold_is_forced_by_the_variable(monkeypatch):
    monkeypatch.setenv("REPROTRAIN_TEST_COLD", "1")
    assert warm.warm_command([sys.executable, "-m", "reprotrain.train"], {}) is None
