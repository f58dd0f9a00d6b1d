"""A tiny Hydra app that gets itself preempted once, to check submitit's requeue plumbing.

    python scripts/requeue_probe.py --multirun --config-dir conf x=0,1 \
        hydra/launcher=submitit_local 'hydra.sweep.dir=OUT/${now:%H-%M-%S-%f}'

Each job appends its pid and job directory to ``incarnations.txt`` in that directory. The
first incarnation sends itself SIGUSR2 (what SLURM sends before a preemption or the time
limit) and waits; submitit's handler re-pickles the job and requeues it. A correct setup
shows two incarnations in one job directory: the requeued job reran the same overrides in
the same place (the sweep dir's ``${now:}`` is cached in the pickled config), which is what
lets the trainer continue there with ``resume=auto``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

ConfigStore.instance().store(name="probe", node={"x": 0})


@hydra.main(config_path=None, config_name="probe", version_base="1.3")
def main(cfg: DictConfig) -> int:
    out = Path(HydraConfig.get().runtime.output_dir)
    seen = out / "incarnations.txt"
    before = len(seen.read_text().splitlines()) if seen.exists() else 0
    with seen.open("a") as f:
        f.write(f"{os.getpid()} x={cfg.x} {out}\n")
    if before == 0:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(120)  # submitit's handler requeues and exits long before this ends
    return before


if __name__ == "__main__":
    main()
