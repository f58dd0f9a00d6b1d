"""Environment and code identity as recorded in run.json."""

import subprocess

import torch

from reprotrain.repro import environment


def test_only_allowlisted_variables_are_recorded(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_marker")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    env = environment.capture(torch.device("cpu"))["env"]
    assert env.get("CUDA_VISIBLE_DEVICES") == "0" and "HF_TOKEN" not in env
    assert "hf_secret_marker" not in repr(environment.capture(torch.device("cpu")))


def test_cpu_identity_includes_the_simd_capability():
    device = environment.capture(torch.device("cpu"))["device"]
    assert device["capability"] == torch.backends.cpu.get_cpu_capability()


def test_no_git_inside_the_image_falls_back_to_the_built_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("REPROTRAIN_GIT_COMMIT", raising=False)
    assert environment.git_info(tmp_path)[0]["commit"] is None
    monkeypatch.setenv("REPROTRAIN_GIT_COMMIT", "0123456789ab-dirty")
    info, diff = environment.git_info(tmp_path)
    assert info["short"] == "01234567" and info["dirty"] is True and diff == ""


def test_untracked_code_is_in_the_diff_but_other_untracked_files_are_not(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "README").write_text("x\n")
    git("add", "README")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "new_model.py").write_text("WIDTH = 3\n")
    (tmp_path / ".env").write_text("API_KEY=do-not-copy\n")
    (tmp_path / "notes.txt").write_text("private notes\n")
    info, diff = environment.git_info(tmp_path)
    assert info["dirty"] is True and "WIDTH = 3" in diff
    assert "do-not-copy" not in diff and "private notes" not in diff
    assert {".env", "notes.txt", "src/new_model.py"} <= set(info["untracked"])
