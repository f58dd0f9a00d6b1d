"""Side-by-side ratios: template vs bare loop, pipelines vs torchvision, strict vs fast,
augmentation fast path, checkpoint cost, logger cost, world-size-invariant step cost.

    make bench                          # quick suite (~3 min on 2 idle cores)
    make bench ARGS="--full"            # more data, epochs and repeats
    make bench ARGS="--device cuda"     # on a GPU (bigger P1 dataset: a GPU epoch is short)
    make bench ARGS="--only P1,P3 --repeats 5"

Every figure is a ratio of two sides measured in this run, interleaved (A, B, A, B, ...),
the median over repeats. Writes outputs/bench/<stamp>/bench.json and bench.md and prints
both paths. Figures (see docs/performance.md):
  P1  template / bare PyTorch loop, train images/s, at strict, warn and fast
  P2  DevicePipeline, LoaderPipeline / torchvision PIL transforms in a DataLoader, images/s
  P3  strict / fast step time; fill_uninitialized_memory on / off step time
  portable  repro=portable / strict step time (x86-64 only; skipped elsewhere)
  P4  reference augmentation gather / fast path, seconds per batch (bit-identical)
  P5  checkpoint save+load / one epoch at 11.0M params (epoch estimated from step time)
  logger  default logger / logger=none (skipped while the config has no logger group)
  replay  a resume's replay (steps, validation, the comparison) / the checkpoint interval it
          replays (one epoch), seconds, measured in the same pair of runs
  overhead  template - bare loop on a null model, microseconds of template work per step
  invariant  world-size-invariant / plain DDP step time, same W, micro-batch and threads
             per rank (torchrun: 2 ranks x 1 thread on CPU/gloo; on CUDA/NCCL one rank per
             GPU, at most 2)
  reference  CUDA: P1 and P3 on the reference model (ResNet-18, batch 512, tf32,
             channels_last) and the projected 30-epoch reference recipe at strict
  strict_cost  CUDA: a ResNet-18 step's images/s per precision x deterministic x cuDNN
             benchmark x layout (benchmarks/reference_model.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks import reference_model
from benchmarks.checkpoint_cost import CheckpointSetup, measure_p5
from benchmarks.invariance_cost import InvariantSetup, measure_invariant
from benchmarks.overhead import OverheadSetup, measure_overhead
from benchmarks.pipelines import PipelineSetup, measure_p2, measure_p4
from benchmarks.results import markdown_table, table_rows, write_outputs
from benchmarks.training import (
    BenchRunError,
    TrainSetup,
    measure_logger,
    measure_p1_p3,
    measure_portable,
    measure_replay,
)
from reprotrain.selfcheck.net import WIDE

FIGURES = ("P1", "P2", "P3", "portable", "P4", "P5", "logger", "replay", "invariant", "overhead",
           *reference_model.FIGURES)  # fmt: skip
TINY = dict(widths=(16, 32, 64), convs_per_stage=1)  # the smoke suite's P5 model


def suite(name: str, device: str, threads: int) -> dict:
    """Sizes per suite. The smoke suite only proves the plumbing (tests); its numbers are
    not meaningful. On a GPU, P1 gets more images so an epoch outlasts launch latency."""
    gpu = device == "cuda"
    # The invariant figure's world size: 2 ranks on CPU; on CUDA one rank per GPU (NCCL
    # refuses two ranks on one GPU), so a one-GPU machine measures it at W=1.
    ranks = min(2, torch.cuda.device_count()) if gpu else 2
    step = (512, 128) if gpu else (128, 32)  # its batch and micro-batch size: k = 4 per step
    # ... and its net: on a GPU the reference model's size (selfcheck.net.WIDE, 11.0M
    # parameters), where the micro-batches fill the GPU; the small net on 2 CPU cores.
    net = {"widths": WIDE["widths"], "convs_per_stage": WIDE["convs_per_stage"]} if gpu else {}
    if name == "smoke":
        return {
            "train": TrainSetup(device, threads, 2, 512, 128, 128, ("strict", "fast"), 1),
            "pipelines": PipelineSetup(device, 1024, 256, 2, 1),
            "augment": dict(batch_size=128, calls=2, repeats=1),
            "checkpoint": CheckpointSetup(device, 64, **TINY, repeats=1),
            "logger_repeats": 1,
            "invariant": InvariantSetup(device, ranks, 1, 2, 256, 64, 64, 16, repeats=1, **net),
            "overhead": OverheadSetup(device, steps=50, epochs=2, repeats=1),
        }
    if name == "quick":
        return {
            "train": TrainSetup(device, threads, 3, 16384 if gpu else 1536, 256, repeats=2),
            "pipelines": PipelineSetup(device, 20_000, 512, 2, 3),
            "augment": dict(batch_size=512, calls=50 if gpu else 20, repeats=5),
            "checkpoint": CheckpointSetup(device, steps_per_repeat=10 if gpu else 1, repeats=2),
            "logger_repeats": 2,
            "invariant": InvariantSetup(
                device, ranks, 1, 3, 16384 if gpu else 3072, 256, *step, 3, **net
            ),
            "overhead": OverheadSetup(device, steps=1000, epochs=3, repeats=3),
        }
    return {  # full
        "train": TrainSetup(device, threads, 5, 50_000 if gpu else 4096, 1024, repeats=5),
        "pipelines": PipelineSetup(device, 20_000, 512, 2, 5),
        "augment": dict(batch_size=512, calls=100 if gpu else 40, repeats=9),
        "checkpoint": CheckpointSetup(device, steps_per_repeat=20 if gpu else 2, repeats=5),
        "logger_repeats": 5,
        "invariant": InvariantSetup(
            device, ranks, 1, 5, 50_000 if gpu else 4096, 1024, *step, 5, **net
        ),
        "overhead": OverheadSetup(device, steps=2000, epochs=4, repeats=5),
    }


def host_info(device: str, threads: int) -> dict:
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    return {
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "threads": threads,
        "python": platform.python_version(),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="the full suite (longer, steadier)")
    mode.add_argument("--smoke", action="store_true", help="seconds-long plumbing check (tests)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    p.add_argument("--repeats", type=int, help="override every figure's repeat count")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(FIGURES)}")
    p.add_argument("--levels", help="P1 levels, comma-separated (default strict,warn,fast)")
    p.add_argument("--out", type=Path, help="output dir (default outputs/bench/<stamp>)")
    args = p.parse_args(argv)
    args.only = set(FIGURES) if not args.only else set(args.only.split(","))
    unknown = args.only - set(FIGURES)
    if unknown:
        p.error(f"unknown figure(s) {', '.join(sorted(unknown))}; choose from {FIGURES}")
    if args.levels:
        args.levels = tuple(args.levels.split(","))
        if not set(args.levels) <= {"strict", "warn", "fast"}:
            p.error(f"--levels {','.join(args.levels)}: choose from strict,warn,fast")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "error: --device cuda but no CUDA device is visible; use --device cpu",
            file=sys.stderr,
        )
        return 2
    name = "smoke" if args.smoke else "full" if args.full else "quick"
    sizes = suite(name, args.device, args.threads)
    if args.repeats is not None:
        sizes["train"].repeats = sizes["pipelines"].repeats = args.repeats
        sizes["checkpoint"].repeats = sizes["augment"]["repeats"] = args.repeats
        sizes["logger_repeats"] = sizes["invariant"].repeats = args.repeats
        sizes["overhead"].repeats = args.repeats
    if args.levels:
        sizes["train"].levels = args.levels
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out_dir = args.out or Path("outputs") / "bench" / stamp
    torch.set_num_threads(args.threads)

    results: dict = {
        "schema": 1,
        "suite": name,
        "device": args.device,
        "stamp": stamp,
        "host": host_info(args.device, args.threads),
        "setup": {
            k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in sizes.items()
        },
    }
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", flush=True)

    try:
        if args.only & {"P1", "P3"}:
            log("P1/P3: template vs bare loop (subprocesses, interleaved)")
            results.update(measure_p1_p3(sizes["train"], out_dir / "runs", log))
        if "portable" in args.only:
            log("portable: repro=portable vs strict template step (interleaved)")
            results["portable"] = measure_portable(sizes["train"], out_dir / "runs-portable", log)
        if "P2" in args.only:
            log("P2: pipelines vs torchvision PIL DataLoader")
            results["P2"] = measure_p2(sizes["pipelines"], log)
        if "P4" in args.only:
            log("P4: augmentation, reference gather vs fast path")
            results["P4"] = measure_p4(args.device, **sizes["augment"], log=log)
        if "P5" in args.only:
            log("P5: checkpoint save+load vs epoch")
            results["P5"] = measure_p5(sizes["checkpoint"], log)
        if "logger" in args.only:
            log("logger: default vs logger=none")
            logger_setup = dataclasses.replace(sizes["train"], repeats=sizes["logger_repeats"])
            results["logger"] = measure_logger(logger_setup, out_dir / "runs-logger", log)
        if "replay" in args.only:
            log("replay: a resume's replay vs the checkpoint interval it replays")
            replay_setup = dataclasses.replace(sizes["train"], repeats=sizes["logger_repeats"])
            results["replay"] = measure_replay(replay_setup, out_dir / "runs-replay", log)
        if "invariant" in args.only:
            ranks = sizes["invariant"].world_size
            log(f"invariant: world-size-invariant vs plain DDP step, {ranks} rank(s), interleaved")
            results["invariant"] = measure_invariant(
                sizes["invariant"], out_dir / "runs-invariant", log
            )
        if "overhead" in args.only:
            log("overhead: template vs bare loop on a null model, us of template work per step")
            overhead_root = out_dir / "runs-overhead"
            results["overhead"] = measure_overhead(sizes["overhead"], overhead_root, log)
        results.update(
            reference_model.measure(
                args.only,
                args.device,
                args.threads,
                name,
                args.repeats,
                out_dir / "runs-reference",
                log,
            )
        )
    except BenchRunError as e:
        print(f"error: a measured run failed: {e}", file=sys.stderr)
        return 1
    results["seconds"] = time.perf_counter() - started
    # CPU seconds of this process and every measured run: on a busy machine the wall time
    # says little about what the suite costs on idle cores, this does.
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    results["cpu_seconds"] = sum(u.ru_utime + u.ru_stime for u in usage)

    json_path, md_path = write_outputs(out_dir, results)
    print()
    print(markdown_table(table_rows(results)), end="")
    print(f"\nbench.json: {json_path}\nbench.md:   {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
