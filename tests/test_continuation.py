"""A resume compares its continuation, and a resume that stretches the schedule has its own
identity (issue 45).

In process: the steps a run logs after its checkpoint (src/reprotrain/resume/continuation.py),
read back by a resume and compared as it recomputes them; ``record_extension`` (start.py).
The trainer end to end: tests/test_resume_replay.py.
"""

from __future__ import annotations

import json

import torch

from reprotrain.config import config_sha256
from reprotrain.resume.continuation import FILE, Continuation, batch_rows, digests, record_verdict
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
    assert all(rows.device == BATCH[0].device for rows in batch_rows(BATCH))


def test_a_steps_digest_does_not_depend_on_the_steps_digested_with_it():
    """The digest is digested at the host read for every pending step at once (one sum per
    tensor per step before that): exact integer sums, so a step flushed alone (a resume's
    first read after a checkpoint) gets the bits it got among others; any changed value
    changes it."""
    other = (BATCH[0] * 3.5 - 1, BATCH[1].flip(0))
    alone = [digests([batch_rows(b)])[0] for b in (BATCH, other, BATCH)]
    assert digests([batch_rows(b) for b in (BATCH, other, BATCH)]) == alone
    assert alone[0] == alone[2] != alone[1]
    nudged = BATCH[0].clone()
    nudged[2, 3] = torch.nextafter(nudged[2, 3], torch.tensor(100.0))  # one ulp
    assert digests([batch_rows((nudged, BATCH[1]))])[0] != alone[0]
    scalar = (torch.tensor(2.0), torch.tensor([1.0, 2.0]))  # rows of another length
    assert digests([batch_rows(scalar), batch_rows(BATCH)])[1] == alone[0]


def test_a_sample_is_digested_by_its_bits_where_it_can_be_viewed_and_by_its_values_else():
    """Per step one op per tensor: a contiguous sample's bytes as 64-bit words summed modulo
    2**64 (no widened copy); a channels-last batch (no such view) its values summed in float64.
    Either way one ulp anywhere, or two samples swapped, changes the digest."""
    images = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([3, 1, 4, 1])
    for layout in (torch.contiguous_format, torch.channels_last):
        batch = (images.contiguous(memory_format=layout), labels)
        rows = batch_rows(batch)
        words = layout == torch.contiguous_format
        assert rows[0].dtype == (torch.int64 if words else torch.float64)
        if words:  # the same sums as the bytes' words summed by hand, wrapped to 64 bits
            raw = [int.from_bytes(images[i].numpy().tobytes()[j : j + 8], "little", signed=True)
                   for i in range(4) for j in range(0, 4 * 3 * 4 * 4, 8)]  # fmt: skip
            by_hand = [sum(raw[i * 24 : (i + 1) * 24]) for i in range(4)]  # 24 words each
            assert rows[0].tolist() == [(v + 2**63) % 2**64 - 2**63 for v in by_hand]
        digest = digests([rows])[0]
        nudged = batch[0].clone(memory_format=torch.preserve_format)
        nudged[3, 2, 1, 0] = torch.nextafter(nudged[3, 2, 1, 0], torch.tensor(100.0))
        swapped = batch[0][[1, 0, 2, 3]].contiguous(memory_format=layout)
        for other in (nudged, swapped):
            assert digests([batch_rows((other, labels))])[0] != digest


def test_the_lines_are_json_dumps_lines_and_one_value_per_sample_of_any_dtype_is_digested(
    tmp_path,
):
    """The file's lines are written by hand (per step, json.dumps cost more than the step):
    each is exactly ``json.dumps`` of the line; a tensor of one value per sample (labels) is
    digested by its values' bits, whatever its dtype (numpy has no bfloat16; complex values
    are two words), so one changed label changes the digest."""
    path = tmp_path / FILE
    lines = logged(path, {4: 0.5, 5: float("nan")}, BATCH).flush() or [
        json.loads(text) for text in path.read_text().splitlines()
    ]
    assert path.read_text() == "".join(json.dumps(line) + "\n" for line in lines)
    for dtype in (torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.complex128):
        labels = torch.tensor([1, 0, 1]).to(dtype)
        changed = torch.tensor([1, 1, 1]).to(dtype)
        digest = digests([batch_rows((BATCH[0], labels))])[0]
        assert digests([batch_rows((BATCH[0], changed))])[0][0] == digest[0]  # the images'
        assert digests([batch_rows((BATCH[0], changed))])[0][1] != digest[1]


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
