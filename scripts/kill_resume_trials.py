"""Preemption drill: SIGKILL a run at random moments, resume it, demand identical bits.

    python scripts/kill_resume_trials.py --trials 5 [overrides...]

Runs the config once uninterrupted, then for each trial starts it fresh, kills it with
SIGKILL after a random delay (seeded, printed), and runs `make resume RUN=...` until the run
completes (a kill can land before the first checkpoint: then resume starts it afresh).
Exit 0 only if every trial ends `completed` with the uninterrupted run's
final_weights_sha256 and the whole state of its newest checkpoint (the comparison a resume's
replay uses: ``resume/replay.first_difference``), and every resume of it recorded itself as
verified by replay (so --trials must be at least 1: zero trials would prove nothing).
A config the trainer refuses (a typo in the overrides) stops the drill with the trainer's
own one-line error and its exit code, before any trial.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from reprotrain.errors import ReprotrainError
from reprotrain.quoting import hydra_override
from reprotrain.run.readers import read_run_json
from reprotrain.tools import cli
from reprotrain.tools.runs.verify import final_state_difference

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ["experiment=selfcheck", "trainer.epochs=4", "trainer.checkpoint_every_steps=5"]


def run_json(run_dir: Path) -> dict:
    return read_run_json(run_dir)


def trials(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


trials.__name__ = "trial count (at least 1)"


def reference_run(train: list[str], ref: Path, env: dict[str, str]) -> float:
    """The uninterrupted run; a refusal or crash ends the drill with the trainer's line."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*train, hydra_override("hydra.run.dir", ref)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        said = [line for line in lines if line.startswith("error:")]
        if said:
            err = ReprotrainError(said[-1].removeprefix("error:").strip())
        else:
            err = ReprotrainError(
                f"the uninterrupted run failed (exit {proc.returncode}): "
                f"{lines[-1] if lines else 'no output'}"
            )
        err.exit_code = proc.returncode if said else 2
        raise err
    return time.perf_counter() - t0


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("scripts/kill_resume_trials.py", __doc__)
    parser.add_argument("--trials", type=trials, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=cli.user_path, default=REPO / "outputs" / "kill-trials")
    parser.add_argument("--nproc", type=trials, default=1, help="torchrun DDP ranks (default 1)")
    parser.add_argument("overrides", nargs="*", default=DEFAULT)
    args = parser.parse_args(argv)
    for parent in (args.out, *args.out.parents):
        if parent.exists() and not parent.is_dir():
            raise ReprotrainError(f"--out {args.out}: {parent}: {os.strerror(errno.ENOTDIR)}")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    train = [sys.executable, "-m", "reprotrain.train", *args.overrides]
    if args.nproc > 1:  # the whole torchrun job is killed: agent and workers, as a node loss
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        train = [sys.executable, *launcher, *train[1:]]
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")

    ref = args.out / stamp / "uninterrupted"
    duration = reference_run(train, ref, env)
    expected = run_json(ref)["final_weights_sha256"]
    print(f"uninterrupted: {duration:.1f} s, final_weights_sha256 {expected[:16]}")

    rng, ok = random.Random(args.seed), True
    for trial in range(1, args.trials + 1):
        run_dir = args.out / stamp / f"trial{trial}"
        delay = rng.uniform(4.0, duration - 1.0)  # ~3.5 s is interpreter + import start-up
        proc = subprocess.Popen(
            [*train, hydra_override("hydra.run.dir", run_dir)],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)  # its process group (workers die with the agent)
        proc.wait()
        time.sleep(0.5)  # let orphaned DDP workers notice their agent is gone
        ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
        resumed = subprocess.run(
            ["make", "-s", "resume", f"RUN={run_dir}"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        try:
            record = run_json(run_dir)
        except ReprotrainError:
            record = {}
        same = record.get("final_weights_sha256") == expected
        difference = final_state_difference(ref, run_dir) if same else None
        claims = [r.get("verified", "not verified") for r in record.get("resumes", [])]
        verified = all(c.endswith(", identical") for c in claims)
        ok &= resumed.returncode == 0 and record.get("status") == "completed" and same
        ok &= difference is None and verified
        print(
            f"trial {trial}: SIGKILL after {delay:.2f} s (newest checkpoint: "
            f"{ckpts[-1] if ckpts else 'none'}), resume exit {resumed.returncode}, "
            f"status {record.get('status')}, final weights "
            f"{'IDENTICAL' if same else 'DIFFERENT'}"
            + (f", final state differs: {difference}" if difference else "")
            + (f"; resume: {claims[-1]}" if claims else "")
        )
        if resumed.returncode != 0:
            said = [x for x in resumed.stderr.splitlines() if x.startswith("error:")]
            print(f"  resume said: {said[-1] if said else resumed.stderr.strip()[-300:]}")
    print("ALL TRIALS BITWISE EQUAL" if ok else "SOME TRIALS DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
