"""Throughput options keep the promise on CPU: bitwise repeatable and resumable at strict."""

import signal

import pytest

from conftest import assert_ok, run_json, train


@pytest.mark.parametrize(
    "option",
    [
        pytest.param("trainer.channels_last=true", id="channels_last"),
        pytest.param("trainer.compile=true", id="compile", marks=pytest.mark.slow),
    ],
)
def test_throughput_option_is_bitwise_repeatable_and_resumable(tmp_path, option):
    every = "trainer.checkpoint_every_steps=3"
    for name in ("a", "b"):
        assert_ok(train(tmp_path / name, option, every))
    a, b = run_json(tmp_path / "a"), run_json(tmp_path / "b")
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    flag = option.split(".")[1].split("=")[0]
    assert a["components"][flag] in (True, "default")
    killed = tmp_path / "killed"
    proc = train(killed, option, every, fault="step:5")
    assert proc.returncode == -signal.SIGKILL
    assert_ok(train(killed, option, every, "resume=auto"))
    assert run_json(killed)["final_weights_sha256"] == a["final_weights_sha256"]
