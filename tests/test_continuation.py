"""A resume compares its continuation, and a resume that stretches the schedule has its own
identity (issue 45).

In process: the steps a run logs after its checkpoint (src/reprotrain/resume/continuation.py),
read back by a resume and compared as it recomputes them; ``record_extension`` (start.py).
The trainer end to end: tests/test_resume_replay.py.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from reprotrain.config import config_sha256
from reprotrain.resume.continuation import (
    FILE,
    Continuation,
    batch_rows,
    digests,
    host_sums,
    record_verdict,
    splitmix64,
)
from reprotrain.resume.guard import ResumePoint
from reprotrain.run.record import RunRecord
from reprotrain.start import record_extension


def logged(path, losses: dict[int, float], batch) -> Continuation:
    """A run that took ``losses`` (global step -> loss) on ``batch`` and wrote them."""
    run = Continuation(path)
    for step, loss in losses.items():
        run.add(step, torch.tensor(loss), batch)
    run.flush()
    return run


BATCH = (torch.arange(12.0).reshape(3, 4), torch.tensor([0, 1, 2]))


def test_steps_after_the_checkpoint_are_compared_and_the_first_difference_is_named(tmp_path):
    path = tmp_path / FILE
    logged(path, {5: 0.5, 6: 0.25, 7: 0.125}, BATCH)
    with open(path, "a") as f:
        f.write('{"global_step": 8, "lo')  # cut by the SIGKILL: left out
    resumed = Continuation(path)
    resumed.load(after=5)  # the checkpoint is step 5's: 6 and 7 are the continuation
    assert resumed.steps == (6, 7) and path.read_text() == ""  # the file starts again
    assert resumed.entry(claim=True)["steps"] == [6, 7]
    resumed.add(6, torch.tensor(0.25), BATCH)
    resumed.flush()
    assert resumed.verdict() is None  # step 7 still to come
    resumed.add(7, torch.tensor(0.1250001), BATCH)
    resumed.flush()
    verdict = resumed.verdict()
    assert verdict["identical"] is False and verdict["compared"] == 2
    assert verdict["first_difference"] == (
        f"step 7: the loss differs ({(0.125).hex()} in the interrupted run, "
        f"{float(torch.tensor(0.1250001)).hex()} now)"
    )
    assert [json.loads(line)["global_step"] for line in path.read_text().splitlines()] == [6, 7]


def test_a_reordered_batch_is_named_and_the_digest_needs_no_host_read(tmp_path):
    path = tmp_path / FILE
    logged(path, {3: 1.0}, BATCH)
    resumed = Continuation(path)
    resumed.load(after=2)
    swapped = (BATCH[0][[1, 0, 2]], BATCH[1])  # the same samples, another order
    resumed.add(3, torch.tensor(1.0), swapped)
    resumed.flush()
    assert resumed.verdict()["first_difference"].startswith("step 3: the batch differs")
    assert all(rows.device == BATCH[0].device for _, rows in batch_rows(BATCH))


def test_a_steps_digest_does_not_depend_on_the_steps_digested_with_it():
    """The digest is finished at the host read for every pending step at once: exact integer
    sums, so a step flushed alone (a resume's first read after a checkpoint) gets the bits it
    got among others, and tensors of another sample count are digested apart."""
    other = (BATCH[0] * 3.5 - 1, BATCH[1].flip(0))
    alone = [digests([batch_rows(b)])[0] for b in (BATCH, other, BATCH)]
    assert digests([batch_rows(b) for b in (BATCH, other, BATCH)]) == alone
    assert alone[0] == alone[2] != alone[1]
    scalar = (torch.tensor(2.0), torch.tensor([1.0, 2.0]))  # rows of another length
    assert digests([batch_rows(scalar), batch_rows(BATCH)])[1] == alone[0]


def _digest(batch) -> list[str]:
    return digests([batch_rows(batch)])[0]


_G = torch.Generator().manual_seed(7)
IMAGES = torch.randn(4, 3, 4, 4, generator=_G)  # a contiguous batch: 64-bit words per sample
ODD = torch.randn(4, 3, generator=_G)  # 12 bytes a sample: no 64-bit view (values were summed)
TOKENS = torch.randint(0, 1000, (4, 6), generator=_G)


def _edited(t: torch.Tensor, *edits) -> torch.Tensor:
    out = t.clone()
    for where, value in edits:
        out[where] = value
    return out


def _bits(t: torch.Tensor, where, pattern: int) -> torch.Tensor:
    """``t`` with the float32 at ``where`` replaced by the bit ``pattern``."""
    out = t.clone()
    out.view(torch.int32)[where] = pattern - (1 << 32 if pattern >> 31 else 0)
    return out


ZERO = _edited(ODD, ((0, 1), 0.0), ((2, 2), 0.0))
SIGNALING_NAN, QUIET_NAN = 0x7F800001, 0x7FC00001  # a NaN's payload, with the quiet bit
# Pairs of different batches the per-sample sum of 64-bit words (plus a place-weighted sum)
# digested alike (issue 53); each must now change the digest.
CHANGES = {
    "features permuted within a sample": (  # whole 64-bit words moved
        IMAGES, _edited(IMAGES, (0, IMAGES[0].reshape(-1).roll(2).reshape(3, 4, 4)))
    ),
    "the same two channels swapped in every sample": (IMAGES, IMAGES[:, [1, 0, 2]]),
    "two sign flips in one sample": (  # float32s in the high halves of two 64-bit words
        IMAGES, _edited(IMAGES, ((0, 0, 0, 1), -IMAGES[0, 0, 0, 1]),
                        ((0, 2, 3, 3), -IMAGES[0, 2, 3, 3])),
    ),
    "two sign flips in two samples": (  # places 1 and 3: 2**63 * (1 + 3) wraps to 0
        IMAGES, _edited(IMAGES, ((0, 1, 1, 1), -IMAGES[0, 1, 1, 1]),
                        ((2, 1, 1, 1), -IMAGES[2, 1, 1, 1])),
    ),
    "+d in one word and -d in another": (
        TOKENS, _edited(TOKENS, ((1, 0), TOKENS[1, 0] + 5), ((1, 4), TOKENS[1, 4] - 5))
    ),
    "-0.0 in place of 0.0": (ZERO, _edited(ZERO, ((2, 2), -0.0))),
    "another NaN payload": (_bits(ODD, (1, 1), SIGNALING_NAN), _bits(ODD, (1, 1), QUIET_NAN)),
    "the same bits as int32 for float32": (IMAGES, IMAGES.view(torch.int32)),
    "the same bits as bfloat16 for float16": (
        IMAGES.half(), IMAGES.half().view(torch.bfloat16)
    ),
    "the same bits as another shape": (IMAGES, IMAGES.reshape(4, 2, 24)),
    "samples permuted within the batch": (IMAGES[[0, 1, 1, 0]], IMAGES[[1, 0, 0, 1]]),
}  # fmt: skip


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_ordinary_change_of_a_batch_changes_its_digest(change):
    """docs/resume.md, "How strong the batch digest is": any change that no one chose knowing
    the digest's weights changes it, but with probability at most 2**-64."""
    a, b = CHANGES[change]
    assert a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(
        torch.uint8), b.reshape(-1).view(torch.uint8)), "the pair is one batch"  # fmt: skip
    assert _digest((a, BATCH[1])) != _digest((b, BATCH[1]))
    assert _digest((a,))[0] != _digest((b,))[0]


def test_the_digest_is_the_two_level_keyed_sum_the_docs_derive_its_bound_from():
    """Each lane: a sample's signed 32-bit words times weights by place, summed modulo 2**64;
    then the header's words (sha256 of dtype and shape) and each sample's value as two
    32-bit words, the same way one level up. Recomputed here in Python integers, as the
    docs state it; any layout (channels-last), any dtype (bool, bytes in odd rows)."""
    w = [splitmix64(k, 256) for k in (1, 2)]
    v = [splitmix64(k, 256) for k in (3, 4)]

    def keyed(words, weights) -> int:
        return sum(int(x) * int(weights[i]) for i, x in enumerate(words)) % 2**64

    def signed(u: int) -> int:
        return u - 2**32 if u >= 2**31 else u

    def by_hand(t: torch.Tensor) -> str:
        samples = t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)
        if samples.dtype == torch.bool:
            samples = samples.view(torch.uint8)
        if samples.shape[1] * samples.element_size() % 4:  # each element its own word
            ints = {1: torch.int8, 2: torch.int16}[samples.element_size()]
            words = samples.contiguous().view(ints).to(torch.int32)
        else:
            words = samples.contiguous().view(torch.int32)
        head = np.frombuffer(hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode()).digest(), "<i4")
        lanes = []
        for k in (0, 1):
            values = [keyed(row.tolist(), w[k]) for row in words]
            halves = [signed(h) for u in values for h in (u & 0xFFFFFFFF, u >> 32)]
            lanes.append(f"{keyed([*head.tolist(), *halves], v[k]):016x}")
        return "".join(lanes)

    batch = (
        IMAGES.contiguous(memory_format=torch.channels_last), TOKENS, ODD.half(),
        torch.tensor([True, False, True]), torch.tensor(3.5, dtype=torch.float64),
        torch.randint(0, 255, (2, 5), dtype=torch.uint8, generator=_G),
    )  # fmt: skip
    assert _digest(batch) == [by_hand(t) for t in batch]


@pytest.mark.parametrize("n", [3, 700])  # numpy's dot for a short row, einsum for a long one
def test_the_hosts_and_the_devices_sums_are_the_same_integers(n):
    """A CPU batch is summed by numpy, a device's by torch: the same sums modulo 2**64."""
    words = torch.randint(-(2**31), 2**31 - 1, (5, n), dtype=torch.int64, generator=_G)
    words = words.to(torch.int32)
    lanes = torch.from_numpy(np.stack([splitmix64(1, n), splitmix64(2, n)]))
    host = torch.from_numpy(host_sums(words.numpy()))
    assert torch.equal(host, (words.unsqueeze(1) * lanes).sum(-1)) and host.dtype == torch.int64
    by_hand = [[sum(int(x) * int(w) for x, w in zip(row, lane, strict=True)) % 2**64
                for lane in lanes] for row in words]  # fmt: skip
    assert [[v % 2**64 for v in row] for row in host.tolist()] == by_hand


def test_a_one_ulp_change_anywhere_in_any_layout_changes_the_digest():
    images = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([3, 1, 4, 1])
    for layout in (torch.contiguous_format, torch.channels_last):
        batch = (images.contiguous(memory_format=layout), labels)
        digest = _digest(batch)
        nudged = batch[0].clone(memory_format=torch.preserve_format)
        nudged[3, 2, 1, 0] = torch.nextafter(nudged[3, 2, 1, 0], torch.tensor(100.0))
        assert _digest((nudged, labels)) != digest


def test_the_lines_are_json_dumps_lines_and_one_value_per_sample_of_any_dtype_is_digested(
    tmp_path,
):
    """The file's lines are written by hand (per step, json.dumps cost more than the step):
    each is exactly ``json.dumps`` of the line; a tensor of one value per sample (labels) is
    digested by its values' bits, whatever its dtype, so one changed label changes the
    digest and leaves the images'."""
    path = tmp_path / FILE
    lines = logged(path, {4: 0.5, 5: float("nan")}, BATCH).flush() or [
        json.loads(text) for text in path.read_text().splitlines()
    ]
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in lines)
    for dtype in (torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.complex128):
        labels = torch.tensor([1, 0, 1]).to(dtype)
        changed = torch.tensor([1, 1, 1]).to(dtype)
        digest = _digest((BATCH[0], labels))
        assert _digest((BATCH[0], changed))[0] == digest[0]  # the images'
        assert _digest((BATCH[0], changed))[1] != digest[1]


def test_a_step_is_digested_as_its_batch_was_when_it_ran_not_as_a_reused_buffer_is_later():
    """Rows wait for the host read: a labels buffer the pipeline (or the step) fills again for
    the next step must not change the digest of the step that already ran."""
    images, labels = BATCH[0].clone(), BATCH[1].clone()
    first = batch_rows((images, labels))
    labels.copy_(labels.flip(0))  # the next step's labels, in the same buffer
    images.mul_(2)
    assert digests([first]) == digests([batch_rows(BATCH)])


def test_identical_steps_let_the_resume_claim_the_bits_and_nothing_logged_says_so(tmp_path):
    record = RunRecord(tmp_path, {"resumes": [{"bitwise_guarantee": False, "unrestored": []}]})
    path = tmp_path / FILE
    logged(path, {4: 0.5}, BATCH)
    resumed = Continuation(path)
    resumed.load(after=3)
    resumed.entry(claim=True)
    resumed.add(4, torch.tensor(0.5), BATCH)
    resumed.flush()
    record_verdict(record, resumed.verdict(), resumed.claim)
    (entry,) = record["resumes"]
    assert entry["bitwise_guarantee"] is True and entry["continuation"]["compared"] == 1

    empty = Continuation(tmp_path / "other.jsonl")
    empty.load(after=4)
    said = empty.entry(claim=True)
    assert said["compared"] == 0 and "logged no step after its checkpoint" in said["reason"]
    assert empty.verdict(stopped=True) is None


def test_a_run_stopped_before_recomputing_every_step_says_which_were_not(tmp_path):
    path = tmp_path / FILE
    logged(path, {4: 0.5, 5: 0.5}, BATCH)
    resumed = Continuation(path)
    resumed.load(after=3)
    resumed.add(4, torch.tensor(0.5), BATCH)
    resumed.flush()
    verdict = resumed.verdict(stopped=True)
    assert verdict["identical"] is True and verdict["compared"] == 1
    assert verdict["reason"] == "the resumed run stopped before recomputing steps 5..5"


def test_a_resume_that_extends_the_epochs_has_its_own_config_hash_and_id(tmp_path):
    """2 -> 3 epochs mid-run is not a 3-epoch run from scratch: `extended_from` enters the
    config's sha256 and so the experiment id; a second resume keeps it."""
    two = {"trainer": {"epochs": 2}, "model": {"width": 4}}
    three = {"trainer": {"epochs": 3}, "model": {"width": 4}}
    record = RunRecord(tmp_path, {"git": {"short": "abc"}, "config_sha256": config_sha256(three)})
    point = ResumePoint(tmp_path / "step-8.pt", {"config": two, "loop": {"global_step": 8}})
    record_extension(record, point, three, torch.device("cpu"))
    assert record["extended_from"] == [{"trainer.epochs": 2, "global_step": 8}]
    assert record["config_sha256"] not in (config_sha256(three), config_sha256(two))
    assert record["experiment_id"].startswith(record["config_sha256"][:8])
    again = ResumePoint(tmp_path / "step-12.pt", {"config": three, "loop": {"global_step": 12}})
    extended = record["config_sha256"]
    record_extension(record, again, three, torch.device("cpu"))
    assert record["config_sha256"] == extended and len(record["extended_from"]) == 1


def test_steps_a_resume_runs_otherwise_by_design_are_not_compared(tmp_path):
    """A resume extending trainer.epochs runs the steps after its checkpoint under the
    stretched schedule: they are not compared, and the record says why."""
    path = tmp_path / FILE
    logged(path, {4: 0.5}, BATCH)
    resumed = Continuation(path)
    resumed.load(after=3)
    said = resumed.entry(claim=True, not_comparable="not compared: this resume extends it")
    assert said == {"compared": 0, "reason": "not compared: this resume extends it"}
    resumed.add(4, torch.tensor(0.75), BATCH)
    resumed.flush()
    assert resumed.verdict(stopped=True) is None and resumed.difference is None
