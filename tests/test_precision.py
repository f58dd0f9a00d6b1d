"""``trainer.precision``: the float math, its own recorded choice apart from the level
(issue 44). Applied and read back once, recorded, part of the identity and the
comparability rule; twins are bitwise at every precision (here on the CPU; on a GPU:
tests/test_gpu.py). Set and read back through torch's ``fp32_precision`` settings on every
backend (issue 55.3): the CUDA ones are set and read back on the CPU build too."""

from __future__ import annotations

import json
import subprocess
import sys

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


#: The three CUDA settings of the four that pick a kernel's rounding (oneDNN's: always ieee).
CUDA = ("cuda.matmul", "cudnn.conv", "cudnn.rnn")


@pytest.mark.parametrize("level", ["strict", "fast"])
@pytest.mark.parametrize("choice", precision.PRECISIONS)
def test_the_precision_alone_sets_torchs_fp32_precision_settings_whatever_the_level(level, choice):
    """Set through the new API and read back from torch: TF32 for cuBLAS matmul, cuDNN conv
    and rnn at tf32 only; oneDNN (the CPU) IEEE at every precision."""
    flags = determinism.apply(level, 1, precision=choice)
    b = torch.backends
    read = {"cuda.matmul": b.cuda.matmul.fp32_precision, "cudnn.conv": b.cudnn.conv.fp32_precision,
            "cudnn.rnn": b.cudnn.rnn.fp32_precision, "generic": b.fp32_precision,
            "mkldnn.matmul": b.mkldnn.matmul.fp32_precision,
            "mkldnn.conv": b.mkldnn.conv.fp32_precision}  # fmt: skip
    cuda = "tf32" if choice == "tf32" else "ieee"
    assert read == dict.fromkeys(read, "ieee") | dict.fromkeys(CUDA, cuda)
    assert {k: flags["fp32_precision"][k] for k in read} == read  # recorded as read back
    assert set(flags["fp32_precision"]) == set(precision.SETTINGS)
    assert flags["deterministic_algorithms"] is (level == "strict")  # the level's, unmoved
    assert flags["precision"] == choice
    assert flags["autocast_dtype"] == {"bf16-mixed": "bfloat16", "16-mixed": "float16"}.get(choice)
    assert flags["grad_scaler"] is (choice == "16-mixed")


@pytest.mark.parametrize("choice", precision.PRECISIONS)
def test_code_that_reads_torchs_legacy_flags_does_not_raise_after_the_precision_is_set(choice):
    """torch raises "a mix of the legacy and new APIs" when a legacy flag disagrees with the
    settings; torch.compile's inductor reads them (its cache key and conv templates)."""
    precision.apply(choice)
    tf32 = choice == "tf32"
    assert torch.backends.cuda.matmul.allow_tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")


FRESH = (
    "import json; from reprotrain.repro import precision; print(json.dumps(precision.settings()))"
)


def test_torchs_defaults_are_what_a_fresh_process_holds():
    """``TORCH_DEFAULTS`` is how the run tells a setting other code made from torch's own."""
    proc = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    assert json.loads(proc.stdout) == precision.TORCH_DEFAULTS


OTHER_CODE = """
import torch, sys
from reprotrain.errors import ReprotrainError
from reprotrain.repro import precision
{setting}
try:
    precision.apply("32-true")
except ReprotrainError as e:
    print(e)
"""


@pytest.mark.parametrize(
    "setting",
    ["torch.backends.cuda.matmul.fp32_precision = 'tf32'",  # the new API
     "torch.backends.fp32_precision = 'tf32'",  # transformers' enable_tf32()
     "torch.set_float32_matmul_precision('high')"],  # Lightning's advice: the legacy API
)  # fmt: skip
def test_a_process_where_other_code_set_the_settings_is_refused_in_one_line(setting):
    proc = subprocess.run([sys.executable, "-c", OTHER_CODE.format(setting=setting)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert lines[0].startswith("torch's fp32_precision settings were changed before the run")
    assert "=tf32 (the run's: ieee)" in lines[0] and "trainer.precision" in lines[0]


def test_a_setting_changed_during_the_run_is_refused_in_one_line():
    """A model, task or callback that sets TF32 itself: checked after the build and at every
    epoch's end (before its checkpoint)."""
    precision.apply("32-true")
    precision.check_unchanged()  # nothing changed: nothing said
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        with pytest.raises(
            ReprotrainError, match=r"changed during the run .*cudnn\.conv=tf32 \(the run's: ieee\)"
        ):
            precision.check_unchanged()
    finally:
        torch.backends.cudnn.conv.fp32_precision = "ieee"


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
    # The same choice read back as other settings (another torch's defaults, other code):
    # each setting is compared, every one of the four among them.
    for key in ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul"):
        a = {"precision": "tf32", "fp32_precision": precision.wanted("tf32")}
        b = {"precision": "tf32", "fp32_precision": {**precision.wanted("tf32"), key: "bf16"}}
        line = comparability.precision_difference(a, b)
        assert line.startswith(f"fp32_precision {key}: ") and "not the same float math" in line
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

    recorded = {"repro": precision.effective("32-true")}
    rerun = {"repro": {**precision.effective("32-true"), "precision": "tf32"}}
    blocking, _ = environment_differences(recorded, rerun)
    assert "precision: 32-true -> tf32 (trainer.precision): not the same float math" in blocking
    assert environment_differences(recorded, recorded)[0] == []  # the same: nothing said
    assert environment_differences(recorded, {})[0] == []  # a preview applies no precision


def test_eval_reads_the_precision_a_run_recorded():
    assert precision.recorded({"precision": "tf32"}) == "tf32"


def test_a_setting_that_does_not_read_back_as_set_stops_the_run(monkeypatch):
    """Something that overrides torch's settings is caught where the precision is applied,
    not recorded as the choice."""
    real, calls = precision.settings, []

    def overridden() -> dict:  # torch's own values at first, then rnn held at ieee
        calls.append(1)
        return real() if len(calls) == 1 else {**real(), "cudnn.rnn": "ieee"}

    monkeypatch.setattr(precision, "settings", overridden)
    with pytest.raises(ReprotrainError, match=r"torch reports cudnn\.rnn=ieee after setting them"):
        precision.apply("tf32")
