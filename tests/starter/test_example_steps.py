"""The worked examples of a step the user owns (src/starter/steps.py): EMA weights and SAM.

Each repeats bitwise, resumes bitwise (in process here: the checkpoint bytes a Saver writes,
loaded weights_only into a fresh model; after a real SIGKILL in the slow tier), works with
micro-batches and with the Exact (world-size-invariant) reduction.
"""

from __future__ import annotations

import io

import pytest
import torch

from conftest import REPO, assert_ok, jsonl, run_json, train
from starter.steps import EMA, SAM, keep_batchnorm_statistics
from step_harness import Harness, batch, tiny_model

STEPS = {"ema": lambda model: EMA(model, decay=0.9), "sam": lambda model: SAM(rho=0.05)}
LAYOUTS = [("local", None), ("local", 4), ("exact", 4)]  # (reduction, microbatch_size)


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize(("reduction", "micro"), LAYOUTS)
def test_the_step_repeats_bitwise_and_differs_from_the_plain_step(name, reduction, micro):
    a = Harness(STEPS[name], reduction=reduction, microbatch_size=micro).run(4)
    b = Harness(STEPS[name], reduction=reduction, microbatch_size=micro).run(4)
    assert a.bits() == b.bits()
    if name == "ema":
        assert all(
            torch.equal(a.user_step.shadow[k], b.user_step.shadow[k]) for k in a.user_step.shadow
        )
    plain = Harness(reduction=reduction, microbatch_size=micro).run(4)
    if name == "sam":
        assert a.bits()[0] != plain.bits()[0]  # SAM's update is its own
    else:
        assert a.bits() == plain.bits()  # EMA only watches: the trained weights are plain


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize(("reduction", "micro"), LAYOUTS)
def test_the_step_resumes_bitwise_from_a_mid_epoch_checkpoint(name, reduction, micro):
    whole = Harness(STEPS[name], reduction=reduction, microbatch_size=micro).run(6)
    first = Harness(STEPS[name], reduction=reduction, microbatch_size=micro).run(3)
    rest = Harness.resumed(first.checkpoint(), STEPS[name], reduction=reduction,
                           microbatch_size=micro).run(3)  # fmt: skip
    assert rest.bits() == whole.bits()
    if name == "ema":
        for k, v in whole.user_step.shadow.items():
            assert torch.equal(rest.user_step.shadow[k], v), k


def test_the_ema_is_in_the_checkpoint_and_validation_uses_it():
    h = Harness(STEPS["ema"]).run(3)
    saved = torch.load(io.BytesIO(h.checkpoint()), weights_only=True)["user_step"]
    assert saved["decay"] == 0.9
    ema = h.user_step.shadow
    assert all(torch.equal(saved["shadow"][k], v) for k, v in ema.items())
    model = h.state.model
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in ema.items())
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with h.user_step.evaluation_weights(model):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in ema.items())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())


def test_the_ema_follows_its_formula():
    model = tiny_model(0)
    ema = EMA(model, decay=0.75)
    before = {k: v.clone() for k, v in ema.shadow.items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model)
    want = before["0.weight"] + 0.25 * (model[0].weight - before["0.weight"])
    assert torch.allclose(ema.shadow["0.weight"], want, atol=1e-6)
    assert torch.equal(ema.shadow["0.bias"], before["0.bias"])  # unchanged weights stay


def test_sam_takes_the_gradient_at_the_perturbed_weights_and_restores_them():
    h = Harness(STEPS["sam"])
    model = h.state.model
    w0 = [p.detach().clone() for p in model.parameters()]
    h.run(1)
    # By hand: g at w0, e = rho g / ||g||, g' at w0 + e (same seeds, BN statistics kept).
    ref = Harness(reduction="local")
    ref.runner.global_step = 0
    ref.runner.gradients(batch(0))
    params = list(ref.state.model.parameters())
    g = torch.cat([p.grad.flatten() for p in params])
    scale = 0.05 / (torch.linalg.vector_norm(g) + 1e-12)
    with torch.no_grad():
        for p in params:
            p.add_(p.grad * scale)
    with keep_batchnorm_statistics(ref.state.model):
        ref.runner.gradients(batch(0))
    for p, w, new in zip(params, w0, model.parameters(), strict=True):
        assert torch.allclose(new, w - 0.2 * p.grad, atol=1e-6)  # SGD's first step at w0


# --- the real thing: a run killed by SIGKILL and resumed (slow tier) -----------------------

KILLED = ["trainer.epochs=1", "trainer.checkpoint_every_steps=3", "trainer.microbatch_size=16",
          "logger=none"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "step", [["step=ema", "step.decay=0.9"], ["step=sam", "trainer.world_size_invariant=true"]]
)
def test_a_run_with_the_step_killed_by_sigkill_resumes_bitwise(tmp_path, step):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert_ok(train(ref, *KILLED, *step))
    killed = train(run, *KILLED, *step, fault="microbatch:5")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert_ok(train(run, *KILLED, *step, "resume=auto"))
    a, b = run_json(ref), run_json(run)
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    assert a["final_metrics"] == b["final_metrics"]  # EMA: evaluated with the EMA weights
    assert jsonl(ref / "fingerprints.jsonl") == jsonl(run / "fingerprints.jsonl")
    assert a["components"]["step"] == b["components"]["step"]
    if "step=ema" in step:
        assert a["components"]["evaluated_with"] == "EMA weights"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["step=sam", "step.rho=0"], "step.rho=0 is refused by starter.steps.SAM"),
        pytest.param(["step=ema", "step.decay=1"], "step.decay=1 is refused by starter.steps.EMA",
                     marks=pytest.mark.slow),  # the same dry build as step.rho=0's
        pytest.param(["dataset=imbalanced", "dataset.positive_fraction=0"],
                     "dataset.positive_fraction=0 is refused", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_a_bad_step_or_dataset_argument_is_refused_before_the_run_dir_exists(
    overrides, says, tmp_path
):
    run_dir = tmp_path / "run"
    proc = train(run_dir, "experiment=smoke", *overrides, micro=False)
    assert proc.returncode == 2
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ") and says in line
    assert not run_dir.exists(), "nothing written: no failed run directory left behind"


def test_the_rooms_callbacks_summarise_the_model_and_keep_a_metric_history(tmp_path):
    """src/starter/callbacks.py: ModelSummary's rows and MetricHistory's state round trip."""
    from torch import nn

    from reprotrain.callbacks import CallbackContext
    from starter.callbacks import MetricHistory, ModelSummary

    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    assert ModelSummary(max_depth=1).rows(model) == [
        ("(model)", "Sequential", 26), ("0", "Linear", 16), ("1", "Sequential", 10)
    ]  # fmt: skip
    assert len(ModelSummary(max_depth=2).rows(model)) == 5
    history = MetricHistory(monitor="val_acc", mode="max")
    ctx = CallbackContext(model, None, 1, 1, tmp_path)
    for value in (0.5, 0.7, 0.6):
        history.on_epoch_end(ctx, {"val_acc": value})
    again = MetricHistory(monitor="val_acc", mode="max")
    again.load_state_dict(history.state_dict())
    assert again.values == [0.5, 0.7, 0.6] and again.best == 0.7
    again.on_end(ctx, {})
    assert '"best": 0.7' in (tmp_path / "metric_history.json").read_text()


def test_callbacks_default_composes_and_every_key_binds():
    """conf/callbacks/default.yaml names the room's callbacks with keys they take."""
    from hydra import compose, initialize_config_dir

    from reprotrain.components import build_callbacks, check_node
    from reprotrain.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "callbacks=default"])
    for name, node in cfg.callbacks.items():
        check_node(node, f"callbacks.{name}")
    assert sorted(build_callbacks(cfg.callbacks)) == ["metric_history", "model_summary"]
