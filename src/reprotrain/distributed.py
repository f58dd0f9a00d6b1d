"""Helpers the training loop uses under ``torchrun``: one process group, rank-0 decisions.

Closes, for many processes: one run directory, the same global batch per step, stopping
together, every rank's RNG in the checkpoint (docs/scaling-out.md). World size 1 without
``torchrun`` creates no process group: every helper gives the single-process answer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from reprotrain.config import check_divisible
from reprotrain.errors import ReprotrainError
from reprotrain.launchers import available_cores, launched_by_submitit

T = TypeVar("T")
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def threads_per_rank(local_world_size: int, cores: int | None = None) -> int:
    """Intra-op threads per process so that processes x threads <= cores on this node."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, local_world_size))


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. ``backend`` is None when no process group exists."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one writer of the run directory (record, metrics, checkpoints)."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(device_ids=[self.device.index] if self.backend == "nccl" else None)

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """Rank ``src``'s ``obj`` on every rank (any picklable value, e.g. the run dir)."""
        if not self.enabled:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self._comm_device)
        return box[0]

    def all_reduce_any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (a stop signal seen by one rank); a
        host sync per call: call it every k steps (the same steps on every rank)."""
        return self.all_reduce_flags(flag)[0]

    def all_reduce_flags(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag True on every rank if it is True on any rank, in one all-reduce."""
        if not self.enabled:
            return tuple(bool(f) for f in flags)
        bits = [1 if f else 0 for f in flags]
        t = torch.tensor(bits, dtype=torch.int32, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank, in place (the identity on one process)."""
        if self.enabled:
            dist.all_reduce(tensor)

    def gather_objects(self, obj: T, dst: int = 0) -> list[T] | None:
        """[obj of rank 0, obj of rank 1, ...] on ``dst``; None on the other ranks."""
        if not self.enabled:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        if self.backend == "nccl":  # gather_object needs the current CUDA device set
            torch.cuda.set_device(self.device)
        dist.gather_object(obj, out, dst=dst)
        return out

    def all_gather_objects(self, obj: T) -> list[T]:
        """Every rank's ``obj`` on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def scatter_objects(self, objs: Sequence[T] | None, src: int = 0) -> T:
        """Entry ``rank`` of ``objs`` (given on ``src`` only): each rank its own RNG state."""
        if not self.enabled:
            assert objs is not None
            return objs[0]
        if self.rank == src and (objs is None or len(objs) != self.world_size):
            raise ReprotrainError(
                f"expected one entry per rank ({self.world_size}), got "
                f"{0 if objs is None else len(objs)}"
            )
        box: list[Any] = [None]
        if self.backend == "nccl":  # scatter_object_list uses the current CUDA device
            torch.cuda.set_device(self.device)
        dist.scatter_object_list(box, list(objs) if self.rank == src else None, src=src)
        return box[0]

    def destroy(self) -> None:
        """Tear the process group down (also on errors, so no rank hangs in a collective)."""
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()

    def as_record(self) -> dict[str, Any]:
        """What run.json records about the job layout."""
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "local_world_size": self.local_world_size,
            "nnodes": max(1, self.world_size // max(1, self.local_world_size)),
        }

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value in (None, "") else int(value)
    except ValueError:
        raise ReprotrainError(f"environment variable {name}={value!r} is not an integer") from None


def init_from_env(device_pref: str = "auto") -> Dist:
    """Join the process group ``torchrun`` describes in the environment, if any: CUDA
    (``device_pref``, ``trainer.device``) means one GPU per local rank and ``nccl``, the CPU
    ``gloo``."""
    if "WORLD_SIZE" not in os.environ:
        export_submitit_tasks()
    world = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ReprotrainError("trainer.device=cuda but no CUDA device is visible; use cpu/auto")
    if use_cuda and local_rank >= torch.cuda.device_count():
        raise ReprotrainError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
            "start at most one process per GPU (--nproc-per-node)"
        )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if world <= 1:
        return Dist(device=device)
    if use_cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": device} if use_cuda else {}
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    return Dist(rank, world, local_rank, local_world, backend, device)


def export_submitit_tasks() -> bool:
    """Map a submitit job's tasks onto torchrun's variables (local rank r uses ``cuda:r``)."""
    if not launched_by_submitit():
        return False
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks <= 1:
        return False
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def shard_global_batch(positions: T, rank: int, world_size: int) -> T:
    """Rank ``rank``'s share of one step's global batch, the one place that decides it: a
    contiguous part of ``positions`` (indices, a tensor or a range), so the union over ranks
    in rank order is the batch a single process trains on."""
    n = len(positions)  # type: ignore[arg-type]
    check_divisible(n, world_size)
    per = n // world_size
    return positions[rank * per : (rank + 1) * per]  # type: ignore[index]
