"""Batches of any shape through both pipelines, in process: pytrees, collate, non-image
tensors, per-sample randomness, workers, mid-epoch starts and the rank-share rule."""

from __future__ import annotations

import pytest
import torch

from reprotrain.batches import leaves
from reprotrain.data.base import InMemoryImages, InMemoryTensors
from reprotrain.data.pipeline import PipelineSpec, build_pipeline, epoch_order
from reprotrain.errors import ReprotrainError
from reprotrain.repro.seeding import Seeds
from starter.sequences import PadTokens, SyntheticSequences
from starter.tabular import SyntheticTabular

SEEDS = Seeds(base=0, init=1, data=2, augment=3, train=4, source="config")
CPU = torch.device("cpu")


def pipeline(dataset, kind="auto", workers=0, batch_size=32, rank=0, world_size=1, **kw):
    spec = PipelineSpec(batch_size, 50, CPU, SEEDS, rank=rank, world_size=world_size, **kw)
    return build_pipeline(kind, dataset.splits(), dataset, workers, spec)


def flat(stream) -> list[torch.Tensor]:
    """Every tensor of every item (steps included), for bitwise comparison."""
    out = []
    for item in stream:
        step, batch = item if isinstance(item, tuple) and isinstance(item[0], int) else (0, item)
        out += [torch.tensor(step), *leaves(batch)]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def sequences(**kw) -> SyntheticSequences:
    return SyntheticSequences(num_train=200, num_test=60, collate=PadTokens(), **kw)


class DictTensors(InMemoryTensors):
    """A nested dict sample: {"x": {"a": float [3], "b": int [2]}, "y": int}."""

    def load_samples(self):
        g = torch.Generator().manual_seed(0)

        def split(n):
            return {"x": {"a": torch.randn(n, 3, generator=g), "b": torch.arange(2 * n).view(n, 2)},
                    "y": torch.arange(n)}  # fmt: skip

        return split(100), split(30)


@pytest.mark.parametrize("kind", ["device", "loader"])
def test_float_features_are_served_as_loaded(kind):
    data = SyntheticTabular(num_train=200, num_test=50, val_fraction=0.0)
    (x, y), _ = data.load_samples()
    p = pipeline(data, kind)
    step, (xb, yb) = next(iter(p.epoch(1)))
    idx = epoch_order(200, SEEDS.data, 1)[:32]
    assert step == 0 and xb.dtype == torch.float32 and xb.shape == (32, 8)
    assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx])  # no /255, no reshape
    xt, yt = next(iter(p.eval_batches("test")))
    (test_x, test_y) = data.load_samples()[1]
    assert torch.equal(xt, test_x[:50]) and torch.equal(yt, test_y[:50])


def test_non_image_tensors_in_the_image_base_are_refused_in_one_line():
    class Tabular(InMemoryImages):
        def load_tensors(self):
            return torch.randn(10, 4), torch.zeros(10).long(), torch.randn(5, 4), torch.zeros(5)

    with pytest.raises(ReprotrainError) as e:
        Tabular(mean=[0.5], std=[0.2]).splits()
    msg = str(e.value)
    assert "\n" not in msg and "torch.float32 [10, 4]" in msg and "InMemoryTensors" in msg


@pytest.mark.parametrize("kind", ["device", "loader"])
def test_nested_dict_batches_are_gathered_split_and_moved_whole(kind):
    data = DictTensors()
    whole = dict(pipeline(data, kind, batch_size=20).epoch(1))
    shares = [dict(pipeline(data, kind, batch_size=20, rank=r, world_size=2).epoch(1))
              for r in (0, 1)]  # fmt: skip
    assert sorted(whole) == list(range(5))
    for step, batch in whole.items():
        assert set(batch) == {"x", "y"} and set(batch["x"]) == {"a", "b"}
        assert batch["x"]["b"].shape == (20, 2) and torch.equal(
            batch["x"]["b"][:, 0] // 2, batch["y"]
        )
        joined = [
            torch.cat(parts) for parts in zip(*(leaves(s[step]) for s in shares), strict=True)
        ]
        assert same(joined, leaves(batch))  # the ranks' shares, in rank order, are the batch


def test_a_collate_pads_variable_length_sequences():
    p = pipeline(sequences(), "loader", batch_size=16)
    lengths = set()
    for _, (tokens, labels) in p.epoch(1):
        real = (tokens != 0).sum(1)
        assert tokens.dtype == torch.int64 and labels.shape == (16,)
        assert tokens.shape[1] == int(real.max())  # padded to the batch's longest
        lengths.add(tokens.shape[1])
    assert len(lengths) > 1  # the padding length changes with the batch
    tokens, labels = next(iter(p.eval_batches("test")))
    assert len(labels) == 50


@pytest.mark.parametrize("workers", [0, 2])
def test_without_a_collate_variable_lengths_fail_in_one_line(workers):
    data = SyntheticSequences(num_train=200, num_test=60)  # no collate: the default stacks
    with pytest.raises(ReprotrainError) as e:
        next(iter(pipeline(data, "loader", workers=workers).epoch(1)))
    assert "\n" not in str(e.value) and "give the dataset a collate" in str(e.value)


def test_a_collate_that_returns_no_tensors_is_one_line():
    data = sequences()
    data.collate = lambda samples: [len(samples)]
    with pytest.raises(ReprotrainError, match="holds a int, not a tensor"):
        next(iter(pipeline(data, "loader").epoch(1)))


def test_collate_batches_are_the_same_with_0_and_2_workers_and_resume_mid_epoch():
    data = sequences()
    runs = {w: flat(s for e in (1, 2) for s in pipeline(data, workers=w).epoch(e))
            for w in (0, 2)}  # fmt: skip
    assert same(runs[0], runs[2])
    tail = flat(pipeline(data, workers=2).epoch(2, start_step=3))
    per_epoch = len(runs[0]) // 2
    assert same(tail, runs[0][per_epoch + 3 * 3 :])  # 3 tensors an item: step, tokens, labels


def test_per_sample_randomness_is_counter_based_and_real():
    data = sequences(token_dropout=0.3)
    p = pipeline(data, workers=0)
    first = dict(p.epoch(1))[0][0]
    again = dict(pipeline(data, workers=2).epoch(1))[0][0]
    assert torch.equal(first, again)
    assert (first == 1).any()  # dropout happened
    clean = dict(pipeline(sequences(token_dropout=0.0)).epoch(1))[0][0]
    assert not torch.equal(first, clean)
    evals = [flat(pipeline(data, workers=w).eval_batches("val")) for w in (0, 2)]
    assert same(*evals) and not (evals[0][1] == 1).any()  # eval: no dropout


def test_rank_shares_of_sample_datasets_cover_the_global_batch():
    """Each rank collates its own share, so it pads to its own longest sequence."""
    data = sequences()
    whole = dict(pipeline(data, batch_size=16).epoch(1))
    shares = [dict(pipeline(data, batch_size=16, rank=r, world_size=2).epoch(1)) for r in (0, 1)]
    for step, (tokens, labels) in whole.items():
        assert torch.equal(torch.cat([s[step][1] for s in shares]), labels)
        for r, share in enumerate(shares):
            mine, width = tokens[8 * r : 8 * (r + 1)], share[step][0].shape[1]
            assert torch.equal(mine[:, :width], share[step][0]) and not mine[:, width:].any()


def test_in_memory_tensors_that_disagree_on_the_sample_count_are_one_line():
    class Ragged(InMemoryTensors):
        def load_samples(self):
            return (torch.zeros(10, 3), torch.zeros(9)), (torch.zeros(4, 3), torch.zeros(4))

    with pytest.raises(ReprotrainError) as e:
        Ragged().splits()
    assert "\n" not in str(e.value) and "train split" in str(e.value)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("+dataset.collate.pad_idd=0", "unknown key 'pad_idd' for starter.sequences.PadTokens"),
        ("dataset.collate._target_=starter.sequences.Pad", "'starter.sequences.Pad' cannot be"),
    ],
)
def test_preflight_checks_the_collate_like_any_target(override, names):
    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()
    preflight.check(["experiment=smoke_sequence"])  # the example itself passes
    with pytest.raises(ReprotrainError) as e:
        preflight.check(["experiment=smoke_sequence", override])
    assert "\n" not in str(e.value) and names in str(e.value)
