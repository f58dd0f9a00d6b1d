"""Reference trainer: compose -> start -> build -> loop -> record. Reads top to bottom.

    python -m reprotrain.train experiment=smoke            # or: make train ARGS="..."
    python -m reprotrain.train --multirun seed.base=0,1,2  # or: make sweep SEEDS=0,1,2

Exit codes (``exits.py``): 0 completed; 2 user error; 75 interrupted after a checkpoint
(resume with ``resume=auto`` or ``make resume``); 130 aborted by a second SIGINT.
"""

from __future__ import annotations

from reprotrain.repro import hashseed

if __name__ == "__main__":
    # PYTHONHASHSEED is only read at interpreter start: re-exec now, before importing torch,
    # if it is not fixed. Then check the overrides while it is still cheap: a typo fails in
    # a second, in one line.
    from reprotrain import launchers

    launchers.die_with_parent()  # torchrun workers die with their agent, never orphaned
    hashseed.ensure()
    from reprotrain import preflight

    preflight.cli_check()

import gc
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from reprotrain import REPO_ROOT, launchers, preflight
from reprotrain.allowlist import allowing
from reprotrain.build import Targets, build
from reprotrain.conf import hydra_callback_targets
from reprotrain.distributed import Dist, init_from_env
from reprotrain.exits import Exits
from reprotrain.hydra_api import VERSION_BASE
from reprotrain.loop import Trainer
from reprotrain.run import record as rec
from reprotrain.start import start

log = logging.getLogger("reprotrain")


def train(cfg: DictConfig, run_dir: Path, dist: Dist) -> float | None:
    """One run in a claimed directory: started, built, fitted (errors raise; ``main`` turns
    them into exit codes)."""
    # start: config validated, kind decided, record opened, controls set, identity
    run = start(cfg, run_dir, dist)
    # build: data, then model (from the `init` stream), optimizer, schedule, task, saver
    parts = build(Targets.of(cfg), run)
    trainer = Trainer(run, parts, cfg.logger)
    # A resume replays the steps since the checkpoint before its own and compares the bits.
    run.restore(trainer)

    # loop and record: epochs, checkpoints on cadence and on signals, the test split
    with trainer.bar:  # closed before a stop's or an error's lines are written
        return trainer.fit()


@hydra.main(config_path=str(REPO_ROOT / "conf"), config_name="train", **VERSION_BASE)
def main(cfg: DictConfig) -> float | None:
    """Hydra's entry: the run directory claimed, then ``train``; each way it can end is an
    exit code (``exits.Exits``)."""
    preflight.register_resolvers()  # joblib/submitit workers never ran cli()
    with Exits(Path(HydraConfig.get().runtime.output_dir)) as ends:
        dist = ends.dist = init_from_env(cfg.trainer.device)
        run_dir = ends.run_dir = Path(dist.broadcast_object(str(ends.run_dir)))  # rank 0's
        rec.set_writer(dist.is_main)
        if not dist.is_main:
            log.setLevel(logging.WARNING)  # one log: rank 0's
        cfg.resume = launchers.default_resume(cfg.resume)  # auto inside a submitit job
        ends.claim(run_dir, cfg.resume)
        return train(cfg, run_dir, dist)


def cli() -> None:
    """Console entry: fix the hash seed, check the overrides in one line, run Hydra (its own
    callbacks are built under Hydra 1.4's allowlist of the targets the wiring names)."""
    launchers.die_with_parent()
    hashseed.ensure()
    preflight.cli_check()
    # torch, Hydra and the framework are imported: the collector's later passes skip their
    # objects (Hydra's composition allocates enough to run it often; ~0.3 s a start)
    gc.freeze()
    with allowing(hydra_callback_targets()):
        main()


if __name__ == "__main__":
    cli()
