"""A process that leaves DataLoader workers alive (an epoch left early, an iterator kept by a
traceback) still exits: the workers ignore SIGTERM, which the interpreter's own exit sends."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO, base_env

LEFT_ALIVE = textwrap.dedent(
    """
    import torch
    from torch.utils.data import DataLoader, Dataset

    import reprotrain.data.pipeline as pipeline

    class Numbers(Dataset):
        def __len__(self):
            return 100

        def __getitem__(self, i):
            return torch.tensor(i)

    loader = DataLoader(Numbers(), batch_size=4, num_workers=2, worker_init_fn=pipeline.seed_worker)
    batches = iter(loader)
    next(batches)  # two live workers that ignore SIGTERM, still referenced at exit
    print("leaving")
    """
)


def test_a_process_with_live_loader_workers_exits_promptly():
    proc = subprocess.run(
        [sys.executable, "-c", LEFT_ALIVE], cwd=REPO, env=base_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "leaving" and "Traceback" not in proc.stderr
