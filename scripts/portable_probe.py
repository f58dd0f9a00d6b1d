"""repro=portable's claim, checked on CPUs nobody here has: `make portable-probe`.

The claim: under ``repro=portable`` every x86-64 CPU with AVX2 computes the same bits (Intel
or AMD, AVX2 or AVX-512). A training run under an emulator is far too slow (the portable
micro smoke did not finish one epoch in 40 minutes under qemu 7.2), so the probe is the
smallest computation that still takes every code path the levers pin: one forward and
backward of a small conv net (oneDNN convolutions, BatchNorm, ReLU, ATen's vectorised
reductions), a linear head (an MKL GEMM), cross-entropy, and two SGD steps with momentum,
on one fixed batch, at one thread. It hashes every parameter, gradient and loss.

    python scripts/portable_probe.py                 # native, then each EMULATED CPU
    python scripts/portable_probe.py --cpus Haswell-v4,EPYC-Rome-v2 --refuse Nehalem
    python scripts/portable_probe.py --one           # one probe in this process (JSON)

Each probe runs in a fresh interpreter: natively, and under ``qemu-x86_64 -cpu <model>``
(Debian's qemu-user; the ``cpuid`` instruction, which torch, oneDNN and MKL dispatch on, is
the emulated CPU's). ``PYTHONHASHSEED`` and the portable levers are set before it starts,
so no re-exec leaves the emulator. Every hash must equal ``PINNED``; a CPU without AVX2
(``--refuse``) must get the one-line refusal of ``repro=portable``. Exit 0 only if all hold.
qemu 7.2 cannot emulate AVX-512: the AVX-512 rows come from real hosts (docs/measured.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from reprotrain.repro.hashseed import PORTABLE_ENV  # noqa: E402  (imports nothing heavy)

#: The probe's hash under repro=portable at one thread, by architecture: measured natively on
#: an AMD EPYC (Zen 5, AVX-512) and under qemu as an Intel Haswell and an AMD EPYC Rome
#: (both AVX2 only); see docs/measured.md.
PINNED = {"x86_64": "d06aec34bda45f334c45f824ebe49053cdf72791b4d6fd107b1790131a3d8bab"}
#: The emulated CPUs `make portable-probe` checks by default: an AVX2-only Intel and AMD.
CPUS = ("Haswell-v4", "EPYC-Rome-v2")
#: A CPU without AVX2, which must be refused in one line.
REFUSE = ("Nehalem",)
BATCH, SIZE, CLASSES = 16, 16, 10  # images, pixels a side, classes
WIDTHS = (16, 32)  # conv channels per stage: enough for oneDNN's blocked AVX2 kernels


def probe(level: str = "portable") -> dict:
    """One probe in this process: the hash, the CPU as the libraries saw it, the seconds.
    ``level="strict"`` runs it on the CPU's native paths (what the levers change)."""
    import torch

    from reprotrain.repro import determinism, machine
    from reprotrain.selfcheck.net import TinyConvNet

    start = time.perf_counter()
    determinism.apply(level, num_threads=1)  # portable: refuses unless its levers hold
    torch.manual_seed(0)  # init stream: weights
    model = TinyConvNet(widths=WIDTHS, num_classes=CLASSES)
    data = torch.Generator().manual_seed(1)  # data: one fixed batch
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=data)
    y = torch.randint(0, CLASSES, (BATCH,), generator=data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    digest = hashlib.sha256()
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        digest.update(loss.detach().numpy().tobytes())
        for p in model.parameters():
            digest.update(p.grad.numpy().tobytes())
        opt.step()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    cpu = machine.capture_cpu()
    return {
        "sha256": digest.hexdigest(),
        "cpu": f"{cpu['vendor']} {cpu['model_name']} (family {cpu['family']}, "
        f"model {cpu['model']})",
        "cpu_source": cpu["source"],
        "capability": cpu["capability"],
        "onednn_isa": cpu["onednn_isa"],
        "mkl_cbwr_branch": cpu["mkl_cbwr_branch"],
        "portable": cpu["portable"],
        "seconds": round(time.perf_counter() - start, 1),
    }


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": "0", **PORTABLE_ENV}
    env.pop("PYTHONPATH", None)
    return env


def run_one(qemu_cpu: str | None, timeout: float) -> dict:
    """The probe in a fresh interpreter, natively or under ``qemu-x86_64 -cpu qemu_cpu``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one"]
    if qemu_cpu:
        cmd = [qemu_binary(), "-cpu", qemu_cpu, *cmd]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    wall = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {proc.returncode}: {last}", "wall_seconds": wall}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall_seconds": wall}


def refusal(qemu_cpu: str, timeout: float) -> tuple[bool, str]:
    """(refused in one line with exit 2, what it printed) for a train under repro=portable."""
    cmd = [qemu_binary(), "-cpu", qemu_cpu, sys.executable, "-m", "reprotrain.train",
           "experiment=selfcheck", "repro=portable", "logger=none",
           f"hydra.run.dir={ROOT / 'outputs' / 'portable-probe-refused'}"]  # fmt: skip
    env = {**child_env(), "PYTHONPATH": str(ROOT / "src")}
    for name in PORTABLE_ENV:  # as a user would start it: the entry point sets the levers
        env.pop(name)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [ln for ln in proc.stderr.splitlines() if "TCG doesn't support" not in ln]
    said = " | ".join(lines)
    one_line = len(lines) == 1 and lines[0].startswith("error: repro=portable needs a CPU")
    return proc.returncode == 2 and one_line, said


def qemu_binary() -> str:
    found = shutil.which("qemu-x86_64")
    if not found:
        raise SystemExit(
            "error: qemu-x86_64 is not on PATH: apt-get install qemu-user (Debian), then "
            "make portable-probe again"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", action="store_true", help="run one probe here, print JSON")
    parser.add_argument(
        "--level",
        default="portable",
        choices=("portable", "strict"),
        help="with --one: the determinism level (strict: native paths)",
    )
    parser.add_argument("--cpus", default=",".join(CPUS), help="qemu CPU models to emulate")
    parser.add_argument("--refuse", default=",".join(REFUSE), help="CPUs that must refuse")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per probe")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(probe(args.level)))
        return 0
    import platform

    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        print(f"error: repro=portable covers x86-64; this host is {machine}", file=sys.stderr)
        return 2
    pinned = PINNED["x86_64"]
    rows = [("native", run_one(None, args.timeout))]
    rows += [(cpu, run_one(cpu, args.timeout)) for cpu in filter(None, args.cpus.split(","))]
    ok = True
    for where, row in rows:
        if "error" in row:
            ok = False
            print(f"FAILED  {where}: {row['error']}")
            continue
        same = row["sha256"] == pinned and row["portable"] is True
        ok &= same
        paths = f"capability {row['capability']}, oneDNN {row['onednn_isa']}, MKL "
        paths += row["mkl_cbwr_branch"]
        print(f"{'same' if same else 'DIFFERS'}  {where}: {row['cpu']} [{row['cpu_source']}], "
              f"{paths}: {row['sha256'][:16]}… in {row['wall_seconds']} s")  # fmt: skip
    refusals = []
    for cpu in filter(None, args.refuse.split(",")):
        refused, said = refusal(cpu, args.timeout)
        ok &= refused
        refusals.append({"cpu": cpu, "refused_in_one_line": refused, "said": said})
        print(f"{'refused' if refused else 'NOT REFUSED'}  {cpu}: {said}")
    verdict = "portable bits hold" if ok else "portable bits DO NOT hold"
    print(f"{verdict}: pinned {pinned[:16]}… ({len(rows)} CPUs, {len(refusals)} refusals)")
    if args.json:
        result = {"pinned": pinned, "probes": dict(rows), "refusals": refusals, "ok": ok}
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
