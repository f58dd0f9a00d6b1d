import subprocess
import sys

import torch
from omegaconf import OmegaConf

from reprotrain.config import SeedConfig
from reprotrain.data.augment import augment_batch
from reprotrain.data.pipeline import EpochBatchSampler, EpochOrder, epoch_order
from reprotrain.repro.seeding import STREAMS, counter_generator, resolve_seeds, stable_hash


def seed_cfg(**kw):
    return OmegaConf.merge(OmegaConf.structured(SeedConfig), kw)


def test_stable_hash_is_the_same_in_processes_with_different_hash_seeds():
    code = "from reprotrain.repro.seeding import stable_hash; print(stable_hash('x', 42, 'init'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": s},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for s in ("1", "2")  # this process runs under a third (make test's 0)
    }
    assert outs == {f"{stable_hash('x', 42, 'init')}\n"}


def test_the_per_micro_batch_seeds_are_stable_hashs_values():
    """The micro-batch and numpy derivations skip ``stable_hash``'s join on the hot path; the
    values are its own (the docs define them by it)."""
    from reprotrain.repro.seeding import microbatch_seed, numpy_seed_words

    for train_seed, step, index in ((0, 0, 0), (42, 12345, 3), (2**62 + 1, 7, 15)):
        seed = microbatch_seed(train_seed, step, index)
        assert seed == stable_hash(train_seed, step, index, "global")
        assert microbatch_seed(train_seed, step, index, "eval", "val") == stable_hash(
            train_seed, step, index, "eval", "val", "global"
        )
        derived = stable_hash(seed, "numpy")
        assert numpy_seed_words(seed) == (derived & 0xFFFFFFFF, derived >> 32)


def test_streams_are_distinct_and_each_can_be_pinned_alone():
    seeds = resolve_seeds(seed_cfg(base=42))
    values = [getattr(seeds, s) for s in STREAMS]
    assert len(set(values)) == 4
    pinned = resolve_seeds(seed_cfg(base=42, data=7))
    assert pinned.data == 7
    assert (pinned.init, pinned.augment, pinned.train) == (seeds.init, seeds.augment, seeds.train)
    other = resolve_seeds(seed_cfg(base=43))
    assert all(getattr(other, s) != getattr(seeds, s) for s in STREAMS)


def test_entropy_seed_is_drawn_and_marked():
    a = resolve_seeds(seed_cfg(base=None, from_entropy=True))
    b = resolve_seeds(seed_cfg(base=None, from_entropy=True))
    assert a.source == b.source == "entropy"
    assert a.base != b.base  # 1 in 2**32 chance of a false failure


def test_counter_generator_depends_only_on_its_inputs():
    torch.manual_seed(0)
    a = torch.rand(4, generator=counter_generator(5, 1, 2))
    torch.rand(100)  # global state moves; the counter-based draw must not
    b = torch.rand(4, generator=counter_generator(5, 1, 2))
    c = torch.rand(4, generator=counter_generator(5, 1, 3))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_epoch_order_is_a_permutation_that_changes_per_epoch():
    o1, o2 = epoch_order(100, 9, 1), epoch_order(100, 9, 2)
    assert sorted(o1.tolist()) == list(range(100))
    assert not torch.equal(o1, o2)
    assert torch.equal(o1, epoch_order(100, 9, 1))


def test_sampler_started_at_step_k_yields_the_tail_of_the_full_epoch():
    full = list(EpochBatchSampler(EpochOrder(100, data_seed=3), 8, epoch=2))
    tail = list(EpochBatchSampler(EpochOrder(100, data_seed=3), 8, epoch=2, steps=range(5, 12)))
    assert len(full) == 12 and tail == full[5:]


def test_augmentation_is_counter_based_crop_and_flip():
    x = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8)
    a, b = augment_batch(x, 1, 1, 0), augment_batch(x, 1, 1, 0)
    assert torch.equal(a, b) and a.shape == x.shape and a.dtype == torch.uint8
    assert not torch.equal(a, augment_batch(x, 1, 1, 1))
    # Every output is a (possibly flipped) 32x32 window of the zero-padded input.
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for i in range(16):
        windows = [padded[i, :, r : r + 32, c : c + 32] for r in range(9) for c in range(9)]
        assert any(torch.equal(a[i], w) or torch.equal(a[i], w.flip(2)) for w in windows)
