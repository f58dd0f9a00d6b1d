"""RNG states in checkpoints (``state.RankRNG``, the part the trainer checkpoints, over
``repro/rng.py``): only the training device's CUDA generator, per rank, loadable with
weights_only=True (a state from cuda:3 of eight resumes where one GPU is visible).

CUDA is faked by monkeypatching ``torch.cuda`` (no GPU here): a fake host with N GPUs whose
generator states are distinct byte tensors, recording every get/set call.
"""

from __future__ import annotations

import io
import logging
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, TINY, assert_ok, base_env, run_json, train
from reprotrain.errors import ResumeError
from reprotrain.repro import rng
from reprotrain.state import RankRNG


class FakeCuda:
    """N visible GPUs; ``gets``/``sets`` record which generators were touched."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.n, self.gets, self.sets = n, [], []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", self.forbidden)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.forbidden)

    @staticmethod
    def state(index: int) -> torch.Tensor:
        return torch.full((16,), index, dtype=torch.uint8)

    def get(self, device=0):
        index = device if isinstance(device, int) else torch.device(device).index
        if index >= self.n:
            raise IndexError(f"no cuda:{index}")
        self.gets.append(index)
        return self.state(index)

    def set(self, state, device=0):
        index = device if isinstance(device, int) else torch.device(device).index
        if index >= self.n:
            raise IndexError(f"no cuda:{index}")
        self.sets.append((index, int(state[0])))

    @staticmethod
    def forbidden(*args, **kwargs):
        raise AssertionError("every visible GPU's generator was touched")


def weights_only_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_python_numpy_and_torch_cpu_states_roundtrip_under_weights_only():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    entry = weights_only_roundtrip(RankRNG(torch.device("cpu")).state_dict())
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    RankRNG(torch.device("cpu")).load_state_dict(entry)
    got = draws()
    assert expected[:2] == got[:2] and torch.equal(expected[2], got[2])


def test_a_cpu_run_holds_no_cuda_state_even_with_gpus_visible(monkeypatch):
    cuda = FakeCuda(monkeypatch, 8)
    assert RankRNG(torch.device("cpu")).state_dict()["cuda"] is None
    assert cuda.gets == []  # no generator read, so CUDA was not even initialised


def test_a_gpu_run_saves_only_its_own_device_generator(monkeypatch):
    cuda = FakeCuda(monkeypatch, 8)
    state = weights_only_roundtrip(rng.capture(torch.device("cuda", 3)))
    assert cuda.gets == [3]
    assert state["cuda"]["device_index"] == 3
    assert torch.equal(state["cuda"]["state"], FakeCuda.state(3))
    assert "torch_cuda" not in state


def test_a_state_saved_on_cuda3_of_eight_resumes_where_one_gpu_is_visible(monkeypatch):
    FakeCuda(monkeypatch, 8)
    saved = RankRNG(torch.device("cuda", 3)).state_dict()
    entry = weights_only_roundtrip({"format": rng.FORMAT, "world_size": 1, "ranks": [saved]})
    cuda = FakeCuda(monkeypatch, 1)
    RankRNG(torch.device("cuda", 0)).load_state_dict(entry)
    assert cuda.sets == [(0, 3)]  # cuda:3's stream continues on this host's only GPU


def test_each_rank_restores_its_own_state(monkeypatch):
    cuda = FakeCuda(monkeypatch, 2)
    torch.manual_seed(0)
    rank0 = rng.capture(torch.device("cuda", 0))
    torch.manual_seed(1)
    rank1 = rng.capture(torch.device("cuda", 1))
    expected_rank1 = torch.rand(4)
    entry = weights_only_roundtrip({"format": rng.FORMAT, "world_size": 2, "ranks": [rank0, rank1]})
    torch.manual_seed(7)
    RankRNG(torch.device("cuda", 1), rank=1).load_state_dict(entry)
    assert torch.equal(torch.rand(4), expected_rank1)
    assert cuda.sets == [(1, 1)]


def test_a_missing_rank_falls_back_to_rank_zero_with_a_warning(caplog):
    entry = {"format": rng.FORMAT, "world_size": 1, "ranks": [rng.capture(torch.device("cpu"))]}
    with caplog.at_level(logging.WARNING, logger="reprotrain"):
        assert rng.for_rank(entry, 3) is entry["ranks"][0]
    assert "world size changed" in caplog.text


def _gather_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from reprotrain.distributed import Dist
    from reprotrain.reduction import DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(100 + rank)
    state = {"rng": RankRNG(torch.device("cpu"), rank).state_dict(), "loop": {"progress": {}}}
    gathered = DDP(Dist(rank=rank, world_size=2, backend="gloo")).checkpoint(state)  # collective
    if rank == 0:
        torch.save(gathered["rng"], out)
    dist.destroy_process_group()


def test_under_ddp_the_entry_holds_every_rank_in_rank_order(tmp_path):
    """Two gloo processes: the trainer's DDP checkpoint gathers each rank's RankRNG state;
    rank 0 writes one entry holding both, in rank order."""
    import torch.multiprocessing as mp

    out = tmp_path / "rng.pt"
    mp.spawn(_gather_worker, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    entry = torch.load(out, weights_only=True)
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    for rank in (0, 1):
        torch.manual_seed(100 + rank)
        assert torch.equal(entry["ranks"][rank]["torch_cpu"], torch.get_rng_state())


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_restore_without_cuda_state_never_touches_cuda(monkeypatch, device):
    cuda = FakeCuda(monkeypatch, 1)
    rng.restore(rng.capture(torch.device("cpu")), torch.device(device))
    assert cuda.sets == [] and cuda.gets == []


# --- rng.Scoped: the guard of the global RNGs, the states of the plain calls ---------------


def _all_states() -> tuple:
    """Every global RNG's whole state: python's (with its cached gauss), numpy's legacy one
    (with its cached Gaussian), torch's CPU generator."""
    _, key, pos, has_gauss, cached = np.random.get_state()
    return random.getstate(), (key.tobytes(), pos, has_gauss, cached), torch.get_rng_state()


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def _everything() -> tuple:
    """A block drawing from every global RNG, Gaussians included (numpy caches one)."""
    return (random.random(), random.gauss(0, 1), float(np.random.normal()),
            float(np.random.rand()), float(torch.rand(())))  # fmt: skip


def _outer(kind: str) -> None:
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    if kind == "cached":  # an odd number of Gaussians drawn outside: both caches hold one
        np.random.normal(), random.gauss(0, 1)


@pytest.mark.parametrize("outer", ["fresh", "cached"])
@pytest.mark.parametrize(
    "block",
    [
        lambda: None,
        _everything,
        lambda: np.random.set_state(np.random.get_state()),
        lambda: np.random.set_bit_generator(np.random.PCG64(5)),
    ],
    ids=["nothing", "draws", "set-state", "swapped-generator"],
)
@pytest.mark.parametrize("route", ["fast", "general"])
def test_scoped_gives_the_states_of_the_plain_calls(monkeypatch, outer, block, route):
    """Inside: the draws the plain seeding calls give for the seed; after: every state as it
    was (the cached Gaussians too), by the copied-words routes and by the general ones."""
    from reprotrain.repro.seeding import numpy_seed_words, stable_hash

    if route == "general":  # a Python whose objects are laid out otherwise
        monkeypatch.setattr(rng, "_PY_AT", None)
        monkeypatch.setattr(rng, "_SPARE_AT", None)
        monkeypatch.setattr(rng, "_GAUSS_AT", None)
    generator = np.random.get_bit_generator()
    for seed in (1, 2**40 + 5, stable_hash("any", 7)):
        _outer(outer)
        before = _all_states()
        random.seed(seed), np.random.seed(numpy_seed_words(seed)), torch.manual_seed(seed)
        block()
        expected = _everything()
        np.random.set_bit_generator(generator)  # as a swapping block left it, put back
        _outer(outer)
        with rng.Scoped(seed, torch.device("cpu")):
            block()
            assert _everything() == expected
        assert np.random.get_bit_generator() is generator
        assert _same(_all_states(), before)
    if route == "fast":  # numpy seeded from the spare (checked once), its Gaussian by memory
        assert rng._GAUSS_AT is not None
        assert rng._SPARE_CHECKED[id(np.random.get_bit_generator())] is True


def test_scoped_seeds_numpy_through_numpy_where_the_spare_cannot(monkeypatch):
    """A seed whose numpy words have a zero high word: Python's key would be one word, so
    numpy seeds itself; the draws are still ``np.random.seed``'s."""
    monkeypatch.setattr(rng, "numpy_seed_words", lambda seed: (seed & 0xFFFFFFFF, 0))
    np.random.seed([12345, 0])
    expected = float(np.random.rand())
    with rng.Scoped(12345):
        assert float(np.random.rand()) == expected


def test_scoped_takes_the_general_route_for_numpy_when_another_generator_was_set_first():
    """numpy's global generator swapped for a PCG64 before reprotrain is imported: no layout
    is assumed (no warning either), the block still gets ``np.random.seed``'s draws and the
    PCG64's state comes back."""
    script = """
import numpy as np
np.random.set_bit_generator(np.random.PCG64(1))
from reprotrain.repro import rng
assert rng._GAUSS_AT is None
before = np.random.get_bit_generator().state
np.random.seed([12345, 678])
expected = np.random.rand()
np.random.get_bit_generator().state = before
rng.numpy_seed_words = lambda seed: (12345, 678)
with rng.Scoped(2):
    assert np.random.rand() == expected
assert np.random.get_bit_generator().state == before
"""
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


# --- a global generator user code installs (issue 53) ---------------------------------------


@pytest.fixture
def numpy_generator_back():
    """numpy's global bit generator as the test found it."""
    found = np.random.get_bit_generator()
    yield
    np.random.set_bit_generator(found)


@pytest.mark.parametrize("kind", ["PCG64", "PCG64DXSM", "Philox", "SFC64"])
def test_any_of_numpys_own_global_bit_generators_is_saved_and_restored(kind, numpy_generator_back):
    """User code may install any of numpy's bit generators as the global one, at any moment:
    the checkpoint holds its kind and state (Philox's arrays too, under weights_only), and a
    restore into a process running another kind puts that kind back, at that state."""
    np.random.set_bit_generator(getattr(np.random, kind)(7))
    np.random.standard_normal()  # a Gaussian cached beside the bit generator's state
    entry = weights_only_roundtrip(RankRNG(torch.device("cpu")).state_dict())
    expected = draws(), np.random.standard_normal()
    np.random.set_bit_generator(np.random.MT19937(9))  # a fresh process's default
    RankRNG(torch.device("cpu")).load_state_dict(entry)
    assert type(np.random.get_bit_generator()).__name__ == kind
    got = draws(), np.random.standard_normal()
    assert got[0][:2] == expected[0][:2] and got[1] == expected[1]


def test_a_bit_generator_numpy_does_not_ship_is_refused_in_one_line(numpy_generator_back):
    from numpy_user_code import OwnBitGenerator

    np.random.set_bit_generator(OwnBitGenerator(1))
    with pytest.raises(ResumeError, match=r"^numpy's global bit generator is numpy_user_code"):
        RankRNG(torch.device("cpu")).state_dict()


def test_a_model_installing_a_pcg64_resumes_bitwise_and_another_kind_is_refused_in_one_line(
    tmp_path,
):
    """The issue's model (a PCG64 installed in ``__init__``, drawn from in ``forward``) died
    at its first checkpoint with a traceback: it checkpoints, and a SIGKILL after step 2
    resumes bitwise; a bit generator numpy does not ship is refused in one line."""
    run, env = tmp_path / "run", base_env(PYTHONPATH=str(REPO / "tests"))
    overrides = ["experiment=selfcheck", *TINY, "trainer.checkpoint_every_steps=1"]
    model = "model._target_=numpy_user_code.Pcg64Net"
    killed = train(run, *overrides, model, micro=False, env=env, fault="step:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert_ok(train(run, *overrides, model, "resume=auto", micro=False, env=env))
    (entry,) = run_json(run)["resumes"]
    assert entry["bitwise_guarantee"] is True, entry
    own = "model._target_=numpy_user_code.OwnBitGeneratorNet"
    refused = train(tmp_path / "own", *overrides, own, micro=False, env=env)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert len(errors) == 1 and "numpy_user_code.OwnBitGenerator" in errors[0]
