"""Bring your own model, optimizer and dataset by config, without editing the core."""

import signal
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import assert_ok, base_env, jsonl, run_json, train
from reprotrain.data.base import val_indices

MLP = textwrap.dedent(
    """
    import torch
    from torch import nn

    class MLP(nn.Module):
        def __init__(self, hidden: int, num_classes: int = 10) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(), nn.Dropout(0.1),
                nn.Linear(hidden, num_classes),
            )

        def forward(self, x):
            return self.net(x)
    """
)


@pytest.fixture(scope="module")
def user_project(tmp_path_factory):
    """A user's own module and YAMLs, outside the repository (nothing in it is edited)."""
    root = tmp_path_factory.mktemp("user")
    (root / "pkg").mkdir()
    (root / "pkg" / "my_models.py").write_text(MLP)
    conf = root / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "optimizer").mkdir()
    (conf / "model" / "my_mlp.yaml").write_text("_target_: my_models.MLP\nhidden: 64\n")
    (conf / "model" / "mlp_typo.yaml").write_text("_target_: my_models.MLP\nhiden: 64\n")
    (conf / "model" / "missing.yaml").write_text("_target_: my_models.NoSuchNet\n")
    (conf / "optimizer" / "rmsprop.yaml").write_text(
        "_target_: torch.optim.RMSprop\n_partial_: true\nlr: 0.001\n"
    )
    env = base_env(PYTHONPATH=str(root / "pkg"))
    # The framework's own configs (experiment=selfcheck) are in the ConfigStore, not on the
    # searchpath: a user's searchpath needs only its own tree.
    return [f"hydra.searchpath=[file://{conf}]"], env


def test_a_new_model_module_and_yaml_train_bitwise_repeatably(tmp_path, user_project):
    search, env = user_project
    for name in ("a", "b"):
        assert_ok(train(tmp_path / name, *search, "model=my_mlp", env=env))
    a, b = run_json(tmp_path / "a"), run_json(tmp_path / "b")
    assert a["components"]["model"] == "my_models.MLP"
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    assert a["final_metrics"]["test_acc"] > 0.15  # above chance (0.1): it trained


def test_an_optimizer_by_yaml_alone_trains_and_is_named(tmp_path, user_project):
    search, env = user_project
    assert_ok(train(tmp_path / "r", *search, "optimizer=rmsprop", env=env))
    record = run_json(tmp_path / "r")
    assert record["components"]["optimizer"] == "torch.optim.rmsprop.RMSprop"
    assert record["status"] == "completed"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model=mlp_typo", "unknown key 'hiden'"),
        ("model=missing", "my_models.NoSuchNet"),
        # Refused when the component is built (after the data is loaded), still one line.
        # Preflight-level values (lr=inf, betas=[0.9], 64-bit seeds...) are rows of the
        # table in test_bad_inputs.py.
        pytest.param(
            "model.widths=[0]",
            "error: model.widths=[0] is refused by reprotrain.selfcheck.net.TinyConvNet",
            marks=pytest.mark.slow,
        ),
        pytest.param("model.num_classes=5", "model.num_classes", marks=pytest.mark.slow),
        pytest.param("dataset.std=[0,0,0]", "dataset.std", marks=pytest.mark.slow),
        pytest.param("dataset.mean=[0.5,0.5]", "dataset.mean", marks=pytest.mark.slow),
    ],
)
def test_bad_component_values_are_one_line_before_training(
    tmp_path, user_project, override, expected
):
    search, env = user_project
    proc = train(tmp_path / "run", *search, override, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    record = tmp_path / "run" / "run.json"
    assert not record.exists() or run_json(tmp_path / "run")["status"] == "failed"


def test_validation_split_depends_only_on_the_data():
    torch.manual_seed(0)
    a = val_indices(1000, 0.1)
    torch.manual_seed(1)
    b = val_indices(1000, 0.1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    train_idx, val_idx = a
    assert len(val_idx) == 100 and not set(train_idx.tolist()) & set(val_idx.tolist())


def test_val_every_epoch_best_on_val_and_test_only_at_the_end(reference_run):
    rows = jsonl(reference_run / "metrics.jsonl")
    assert rows and all("val_acc" in r and "val_loss" in r for r in rows)
    assert not any(k.startswith("test_") for r in rows for k in r)
    record = run_json(reference_run)
    final = record["final_metrics"]
    assert 0 <= final["test_acc"] <= 1 and "test_loss" in final
    best = max(rows, key=lambda r: r["val_acc"])["epoch"]
    assert (reference_run / "checkpoints" / "best.pt").is_file()
    assert final.get("best_epoch", rows[-1]["epoch"]) == best


def test_no_decay_group_for_norms_and_biases_is_recorded(tmp_path):
    assert_ok(train(tmp_path / "r", "trainer.no_decay_norm_bias=true", "trainer.epochs=1"))
    groups = run_json(tmp_path / "r")["components"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [5e-4, 0.0]
    assert groups[0]["params"] > 0 and groups[1]["params"] > 0


# ------------------------------------------------------------------------ image folders


def write_folder(root: Path, classes: int = 10, train_per: int = 12, test_per: int = 3) -> Path:
    """PNGs of mixed sizes in the ImageFolder layout; each class has its own colour."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, per in (("train", train_per), ("test", test_per)):
        for c in range(classes):
            d = root / split / f"class_{c:02d}"
            d.mkdir(parents=True)
            for i in range(per):
                h, w = 20 + (i * 7) % 21, 24 + (i * 5) % 17
                base = torch.tensor([(c * 25) % 256, (c * 70) % 256, (c * 140) % 256])
                noise = torch.randint(-30, 31, (3, h, w), generator=g)
                img = (base.view(3, 1, 1) + noise).clamp(0, 255).to(torch.uint8)
                Image.fromarray(img.permute(1, 2, 0).numpy()).save(d / f"img_{i:03d}.png")
    return root


FOLDER = [
    "experiment=selfcheck",
    "trainer.epochs=2",
    "dataset=image_folder",
    "trainer.batch_size=32",
    "trainer.checkpoint_every_steps=2",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("images") / "data")


@pytest.fixture(scope="module")
def folder_reference(tmp_path_factory, folder):
    run = tmp_path_factory.mktemp("folder") / "ref"
    assert_ok(train(run, *FOLDER, f"dataset.root={folder}", "trainer.num_workers=0", micro=False))
    return run


def test_image_folder_trains_and_num_workers_do_not_change_the_bits(
    tmp_path, folder, folder_reference
):
    w2 = (*FOLDER, f"dataset.root={folder}", "trainer.num_workers=2")
    assert_ok(train(tmp_path / "w2", *w2, micro=False))
    a, b = run_json(folder_reference), run_json(tmp_path / "w2")
    assert a["status"] == "completed" and a["components"]["dataset"].endswith("ImageFolderData")
    assert a["final_weights_sha256"] == b["final_weights_sha256"]
    assert jsonl(folder_reference / "fingerprints.jsonl") == jsonl(
        tmp_path / "w2/fingerprints.jsonl"
    )
    assert a["data_fingerprint"]["sha256"] and a["data_fingerprint"]["num_files"] == 150


def test_image_folder_sigkill_mid_epoch_then_resume_is_bitwise(tmp_path, folder, folder_reference):
    run = tmp_path / "killed"
    overrides = (*FOLDER, f"dataset.root={folder}", "trainer.num_workers=2")
    proc = train(run, *overrides, fault="step:3", micro=False)  # mid-epoch 2 (3 steps per epoch)
    assert proc.returncode == -signal.SIGKILL
    assert_ok(train(run, *overrides, "resume=auto", micro=False))
    assert (
        run_json(run)["final_weights_sha256"] == run_json(folder_reference)["final_weights_sha256"]
    )


def test_fingerprint_follows_the_folder_files(tmp_path):
    from reprotrain.data.image_folder import ImageFolderData

    root = write_folder(tmp_path / "d", classes=2, train_per=2, test_per=1)
    before = ImageFolderData(str(root)).fingerprint()["sha256"]
    png = next((root / "train" / "class_00").iterdir())
    png.rename(root / "train" / "class_01" / "moved.png")
    assert ImageFolderData(str(root)).fingerprint()["sha256"] != before


@pytest.mark.parametrize("case", ["missing root", "empty class", "unreadable image"])
def test_bad_image_folders_are_one_line(tmp_path, case):
    root = write_folder(tmp_path / "d", classes=2, train_per=4, test_per=1)
    if case == "missing root":
        root, expected = tmp_path / "nowhere", "does not exist"
    elif case == "empty class":
        for p in (root / "train" / "class_01").iterdir():
            p.unlink()
        expected = "class_01"
    else:
        (root / "train" / "class_00" / "img_000.png").write_bytes(b"not a png")
        expected = "img_000.png"
    overrides = ["experiment=selfcheck", "dataset=image_folder", "trainer.batch_size=2"]
    overrides.append("model.num_classes=2")
    proc = train(tmp_path / "run", *overrides, f"dataset.root={root}", micro=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in proc.stderr
    assert run_json(tmp_path / "run")["status"] == "failed"


def test_images_edited_between_a_kill_and_the_resume_are_named_and_never_re_recorded(tmp_path):
    """Issue 34's data kind: image files edited after a SIGKILL. The start's fingerprint
    stays in run.json; under strict the resume is refused in one line (the replay from the
    checkpoint before runs on the new pixels and differs), at repro=warn it goes on,
    recorded as not bitwise, with the data change named."""
    import shutil

    from PIL import Image

    data = write_folder(tmp_path / "data")
    runs = {}
    for level in ("strict", "warn"):
        root = tmp_path / level / "data"
        shutil.copytree(data, root)
        run = tmp_path / level / "run"
        overrides = (*FOLDER, f"dataset.root={root}", "trainer.num_workers=0", f"repro={level}")
        killed = train(run, *overrides, fault="step:5", micro=False)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        at_start = run_json(run)["data_fingerprint"]
        for png in sorted((root / "train").rglob("*.png")):  # every training image, edited
            img = Image.open(png)
            Image.eval(img, lambda v: 255 - v).save(png)
        runs[level] = (run, overrides, at_start)

    run, overrides, at_start = runs["strict"]
    before = (run / "run.json").read_bytes()
    refused = train(run, *overrides, "resume=auto", micro=False)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
    assert "differ: model." in line  # the replay's first differing entry
    assert "what the run reads changed since it started (data: the dataset changed" in line
    assert (run / "run.json").read_bytes() == before

    run, overrides, at_start = runs["warn"]
    assert_ok(train(run, *overrides, "resume=auto", micro=False))
    record = run_json(run)
    assert record["data_fingerprint"] == at_start  # never silently re-recorded
    (entry,) = record["resumes"]
    assert entry["bitwise_guarantee"] is False
    assert any(m.startswith("data: the dataset changed") for m in entry["mismatch"])
