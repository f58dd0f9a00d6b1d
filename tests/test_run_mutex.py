"""One writer per run directory (run/mutex.py), checked with real processes.

Holders and contenders are separate Python processes (stdlib + the lock module only, so each
starts in a fraction of a second): the refusal, the SIGKILL takeover and the pid-reuse guard
are about process lifetimes, which one process cannot fake.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprotrain.errors import ReprotrainError
from reprotrain.run import mutex as run_mutex
from reprotrain.run.mutex import LOCK_NAME, Holder, RunBusyError, RunMutex

HOLD = """
import sys, time
from reprotrain.run.mutex import RunMutex
with RunMutex(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # hold until the test closes stdin (or kills us)
"""

# The holder forks a child that outlives it, as DataLoader workers briefly do after a SIGKILL.
HOLD_AND_FORK = """
import os, sys, time
from reprotrain.run.mutex import RunMutex
lock = RunMutex(sys.argv[1]).acquire()
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
sys.stdin.read()
"""

# Exit 0 and print "acquired": got it. Exit 2 and one "error: ..." line: refused (as the
# trainer reports a ReprotrainError). Optional argv[2]: wall-clock time to start at.
TRY = """
import sys, time
from reprotrain.errors import ReprotrainError
from reprotrain.run.mutex import RunMutex
if len(sys.argv) > 2:
    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
try:
    lock = RunMutex(sys.argv[1]).acquire()
except ReprotrainError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
print("acquired", flush=True)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
lock.release()
"""


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def start_holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def try_lock(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", TRY, str(run_dir), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
    )


def snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime, and the directory's own mtime."""
    out = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.iterdir())}
    out["<dir>"] = (b"", d.stat().st_mtime_ns)
    return out


def write_lock(run_dir: Path, holder: Holder, age_s: float = 0.0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(holder.to_json())
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_second_writer_is_refused_in_one_line_naming_the_holder_and_dir_untouched(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    try:
        (run_dir / "run.json").write_text('{"status": "running"}')
        before = snapshot(run_dir)
        proc = try_lock(run_dir)
        after = snapshot(run_dir)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert f"pid {holder.pid}" in lines[0] and socket.gethostname() in lines[0]
    assert "started 20" in lines[0]  # the holder's start time (ISO date)
    assert "Traceback" not in proc.stderr and "acquired" not in proc.stdout
    assert after == before
    # and the holder released it on its normal exit
    assert holder.returncode == 0 and not (run_dir / LOCK_NAME).exists()


def test_lock_left_by_a_sigkilled_holder_is_taken_over_with_a_warning(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    left = json.loads((run_dir / LOCK_NAME).read_text())
    assert left["pid"] == holder.pid  # SIGKILL leaves the lock behind

    proc = try_lock(run_dir)
    assert proc.returncode == 0, proc.stderr
    assert "acquired" in proc.stdout
    assert "taking over the lock" in proc.stderr and f"pid {holder.pid}" in proc.stderr
    assert "that process is gone" in proc.stderr
    assert not (run_dir / LOCK_NAME).exists()  # the new holder released it on exit


def test_a_reused_pid_is_not_mistaken_for_the_dead_holder(tmp_path):
    """A lock naming a live pid is refused only if that pid still has the recorded start time."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real = Holder.me()
        ticks = run_mutex.proc_start_ticks(other.pid)
        assert ticks is not None
        same = Holder(**{**real.__dict__, "pid": other.pid, "pid_start": ticks, "token": "a"})
        reused = Holder(**{**same.__dict__, "pid_start": ticks - 1, "token": "b"})

        write_lock(tmp_path / "live", same)
        refused = try_lock(tmp_path / "live")
        assert refused.returncode == 2 and f"pid {other.pid}" in refused.stderr

        write_lock(tmp_path / "reused", reused)
        taken = try_lock(tmp_path / "reused")
        assert taken.returncode == 0, taken.stderr
        assert "that pid now belongs to another process" in taken.stderr
    finally:
        other.kill()
        other.wait()


def test_only_one_of_several_simultaneous_contenders_takes_over_a_dead_lock(tmp_path):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    go = f"{time.time() + 1.5:.3f}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRY, str(run_dir), go, "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        for _ in range(4)
    ]
    codes = [p.wait(timeout=60) for p in procs]
    assert sorted(codes) == [0, 2, 2, 2], [p.stderr.read() for p in procs]


def test_released_on_normal_exit_and_on_exceptions(tmp_path):
    with RunMutex(tmp_path / "a") as lock:
        assert (tmp_path / "a" / LOCK_NAME).exists()
        lock.check()
    assert not (tmp_path / "a" / LOCK_NAME).exists()

    with pytest.raises(ZeroDivisionError), RunMutex(tmp_path / "b"):
        raise ZeroDivisionError
    assert not (tmp_path / "b" / LOCK_NAME).exists()


def test_another_hosts_lock_is_refused_until_its_heartbeat_is_stale(tmp_path):
    far = Holder(host="node-that-is-not-here", pid=4242, started_at="2026-01-01T00:00:00+00:00")
    write_lock(tmp_path / "fresh", far, age_s=5)
    with pytest.raises(RunBusyError, match="host node-that-is-not-here, pid 4242"):
        RunMutex(tmp_path / "fresh", stale_after_s=60).acquire()

    write_lock(tmp_path / "stale", far, age_s=120)
    lock = RunMutex(tmp_path / "stale", stale_after_s=60).acquire()
    assert lock.took_over == far
    lock.release()


def test_the_heartbeat_keeps_a_long_run_from_looking_stale(tmp_path):
    lock = RunMutex(tmp_path, heartbeat_s=0.05).acquire()
    try:
        path = tmp_path / LOCK_NAME
        os.utime(path, (time.time() - 1000, time.time() - 1000))
        time.sleep(0.5)
        assert time.time() - path.stat().st_mtime < 10
    finally:
        lock.release()


def test_a_requeued_slurm_job_takes_over_its_previous_incarnation(tmp_path, monkeypatch):
    old = Holder(host="node-a", pid=99, started_at="t", job_id="1234", job_restart=0, token="x")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # same incarnation elsewhere: still alive
    write_lock(tmp_path / "same", old)
    with pytest.raises(RunBusyError):
        RunMutex(tmp_path / "same").acquire()

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    write_lock(tmp_path / "requeued", old)
    lock = RunMutex(tmp_path / "requeued").acquire()
    assert lock.took_over == old
    lock.release()


def test_check_reports_a_lock_that_another_process_replaced(tmp_path):
    lock = RunMutex(tmp_path).acquire()
    try:
        (tmp_path / LOCK_NAME).unlink()
        write_lock(tmp_path, Holder(host="h", pid=1, started_at="t", token="other"))
        with pytest.raises(RunBusyError, match="taken over"):
            lock.check()
    finally:
        lock.release()
    assert (tmp_path / LOCK_NAME).exists()  # not ours: left alone


def test_refuse_if_held_only_reads(tmp_path):
    run_mutex.refuse_if_held(tmp_path / "nothing-here")  # no lock: fine
    assert not (tmp_path / "nothing-here").exists()
    with RunMutex(tmp_path / "run"):
        before = snapshot(tmp_path / "run")
        with pytest.raises(ReprotrainError, match=f"pid {os.getpid()}"):
            run_mutex.refuse_if_held(tmp_path / "run")
        assert snapshot(tmp_path / "run") == before


def test_two_contenders_that_both_saw_a_dead_holder_cannot_both_take_over(tmp_path):
    """The interleaving the simultaneous test may not hit: both judged it dead, then A wins."""
    dead = Holder(host="gone", pid=7, started_at="t", token="dead")
    write_lock(tmp_path, dead, age_s=10_000)
    a, b = RunMutex(tmp_path), RunMutex(tmp_path)
    (seen_a, why_a), (seen_b, why_b) = a._inspect(), b._inspect()
    assert seen_a == seen_b == dead and why_a and why_b
    assert a._take_over(seen_a, why_a)
    try:
        assert not b._take_over(seen_b, why_b)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == a.me.token
    finally:
        a.release()


def test_a_zombie_holder_counts_as_dead(tmp_path):
    """A SIGKILLed holder whose parent has not reaped it yet still has a pid; it writes
    nothing more, so its lock is taken over (torchrun workers killed with their agent)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline
        time.sleep(0.05)
    try:
        ticks = run_mutex.proc_start_ticks(child.pid)
        zombie = Holder(**{**Holder.me().__dict__, "pid": child.pid, "pid_start": ticks})
        write_lock(tmp_path, zombie)
        lock = RunMutex(tmp_path).acquire()
        assert lock.took_over == zombie
        lock.release()
    finally:
        child.wait()


def test_a_forked_child_that_outlives_the_holder_does_not_keep_the_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_FORK, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.send_signal(signal.SIGKILL)  # the parent only; the child sleeps on
        holder.wait(timeout=30)
        proc = try_lock(tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "taking over the lock" in proc.stderr
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
