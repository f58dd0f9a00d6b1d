"""``trainer.precision``: the float math, its own recorded choice apart from the level
(issue 44). Applied and read back once, recorded, part of the identity and the
comparability rule; twins are bitwise at every precision (here on the CPU; on a GPU:
tests/test_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

import reprotrain.train as trainer
from reprotrain import CONF_DIR
from reprotrain.config import register_configs
from reprotrain.distributed import Dist
from reprotrain.errors import ReprotrainError
from reprotrain.repro import comparability, determinism, precision
from reprotrain.run.record import RUN_JSON

register_configs()


@pytest.fixture(autouse=True)
def restore_torch_globals():
    threads = torch.get_num_threads()
    yield
    determinism.apply("fast", threads)
    precision.apply("32-true")
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, False


@pytest.mark.parametrize("level", ["strict", "fast"])
@pytest.mark.parametrize("choice", precision.PRECISIONS)
def test_the_precision_alone_decides_tf32_and_autocast_whatever_the_level(level, choice):
    flags = determinism.apply(level, 1, precision=choice)
    tf32 = choice == "tf32"
    assert (flags["tf32_matmul"], flags["tf32_cudnn"]) == (tf32, tf32)  # read back
    assert flags["float32_matmul_precision"] == ("high" if tf32 else "highest")
    assert flags["deterministic_algorithms"] is (level == "strict")  # the level's, unmoved
    assert flags["precision"] == choice
    assert flags["autocast_dtype"] == {"bf16-mixed": "bfloat16", "16-mixed": "float16"}.get(choice)
    assert flags["grad_scaler"] is (choice == "16-mixed")


@pytest.mark.parametrize("choice", precision.PRECISIONS)
def test_the_cpu_libraries_stay_ieee_float32_at_every_precision(choice):
    """torch's "high" matmul precision is leave for oneDNN to round float32 matmuls on the
    CPU; the precision sets only the CUDA flags, so CPU math is the same as at 32-true."""
    flags = precision.apply(choice)
    if flags["cpu_matmul_fp32_precision"] is None:
        pytest.skip("this torch has no per-backend fp32 precision (torch < 2.9)")
    assert flags["cpu_matmul_fp32_precision"] == "ieee"


def test_an_unknown_precision_is_one_line():
    with pytest.raises(ReprotrainError, match="choose one of 32-true, tf32, bf16-mixed, 16-mixed"):
        determinism.apply("strict", 1, precision="fp8")


def test_a_misspelt_precision_fails_at_compose_time():
    from reprotrain.config import validate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=selfcheck", "trainer.precision=bf16"])
    with pytest.raises(ReprotrainError, match=r"trainer\.precision"):
        validate(cfg, 1)


def train_in_process(run_dir, choice: str, *extra: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "experiment=selfcheck",
                f"trainer.precision={choice}",
                "dataset.num_train=192",
                "dataset.num_test=64",
                "trainer.batch_size=64",
                "trainer.epochs=1",
                "logger=none",
                *extra,
            ],
        )
    trainer.train(cfg, run_dir, Dist())
    return json.loads((run_dir / RUN_JSON).read_text())


# 32-true twins are the suite's own (test_train.py); tf32 has 32-true's bits on the CPU
# (below): in the slow tier. The mixed precisions change the CPU math: default tier.
TWINS = [pytest.param(p, marks=pytest.mark.slow) for p in ("32-true", "tf32")]


@pytest.mark.parametrize("choice", [*TWINS, "bf16-mixed", "16-mixed"])
def test_twins_are_bitwise_at_every_precision_on_the_cpu(tmp_path, choice):
    a = train_in_process(tmp_path / "a", choice)
    b = train_in_process(tmp_path / "b", choice)
    assert a["status"] == b["status"] == "completed"
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    # Recorded (read back) and part of the identity.
    assert a["repro"]["precision"] == choice
    assert a["experiment_id"].endswith(f"-{choice}")
    assert a["config_sha256"] == b["config_sha256"]


def test_tf32_changes_nothing_on_the_cpu_and_mixed_precision_does(tmp_path):
    """TF32 is a CUDA format: on the CPU a tf32 run has the bits of 32-true (what the
    reference job's CUDA default means for a CPU user), while bf16 autocast changes them.
    The configs differ, so the identities do."""
    full = train_in_process(tmp_path / "32", "32-true")
    tf32 = train_in_process(tmp_path / "tf32", "tf32")
    bf16 = train_in_process(tmp_path / "bf16", "bf16-mixed")
    assert tf32["final_weights_sha256"] == full["final_weights_sha256"]
    assert bf16["final_weights_sha256"] != full["final_weights_sha256"]
    assert len({r["config_sha256"] for r in (full, tf32, bf16)}) == 3


def test_a_changed_precision_is_one_line_of_the_comparability_rule():
    line = comparability.precision_difference({"precision": "32-true"}, {"precision": "tf32"})
    assert line == "precision: 32-true -> tf32 (trainer.precision): not the same float math"
    assert comparability.precision_difference({"precision": "tf32"}, {"precision": "tf32"}) is None
    # A record from before the key: its runs were 32-true on the CPU (TF32 only ever on a GPU
    # at repro=fast): "not recorded" counts as a difference, never as a silent match.
    assert "not recorded" in comparability.precision_difference({}, {"precision": "32-true"})


def test_the_reference_experiment_runs_tf32_channels_last_at_strict():
    """docs/gpus.md, "The reference GPU setting": the reference job's default on CUDA."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=cifar10_resnet18"])
    assert (cfg.trainer.device, cfg.trainer.precision) == ("cuda", "tf32")
    assert cfg.trainer.channels_last is True and cfg.repro.level == "strict"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        default = compose("train", overrides=["experiment=smoke"])
    assert default.trainer.precision == "32-true"  # everywhere else: full float32


def test_help_shows_the_precision_key_and_every_choice():
    import subprocess
    import sys

    from conftest import REPO, base_env

    proc = subprocess.run([sys.executable, "-m", "reprotrain.train", "--help"], cwd=REPO,
                          env=base_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert "precision: 32-true" in proc.stdout  # the config's default
    assert " | ".join(precision.PRECISIONS) in proc.stdout  # the choices, in the examples


def test_a_resume_under_another_precision_is_refused_naming_the_key():
    from reprotrain.resume.guard import config_differences

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        a = compose("train", overrides=["experiment=selfcheck"])
        b = compose("train", overrides=["experiment=selfcheck", "trainer.precision=tf32"])
    from omegaconf import OmegaConf

    recorded, current = (OmegaConf.to_container(c, resolve=True) for c in (a, b))
    assert config_differences(recorded, current) == ["trainer.precision"]


def test_a_reproduce_whose_rerun_recorded_another_precision_is_not_comparable():
    from reprotrain.tools.reproduce.rerun import environment_differences

    recorded = {"repro": {"precision": "32-true", "tf32_matmul": False, "tf32_cudnn": False}}
    rerun = {"repro": {"precision": "tf32", "tf32_matmul": True, "tf32_cudnn": True}}
    blocking, _ = environment_differences(recorded, rerun)
    assert "precision: 32-true -> tf32 (trainer.precision): not the same float math" in blocking
    assert environment_differences(recorded, recorded)[0] == []  # the same: nothing said
    assert environment_differences(recorded, {})[0] == []  # a preview applies no precision


def test_eval_reads_the_precision_a_run_recorded():
    assert precision.recorded({"precision": "tf32"}) == "tf32"


def test_a_flag_that_does_not_read_back_as_set_stops_the_run(monkeypatch):
    """Something that overrides torch's flags (a library, a sitecustomize) is caught where
    the precision is applied, not recorded as the choice."""
    real = precision.effective
    monkeypatch.setattr(precision, "effective", lambda p: {**real(p), "tf32_cudnn": False})
    with pytest.raises(ReprotrainError, match="cuDNN=False after setting them"):
        precision.apply("tf32")
