"""The Hydra and OmegaConf calls whose spelling changed in Hydra 1.4 / OmegaConf 2.4: one home,
so the one-line errors stay one line there (each old spelling prints a deprecation warning to
stderr before the error: tests/test_hydra14.py runs the one-line tests under 1.4)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hydra
import omegaconf
from omegaconf import OmegaConf


def _at_least(version: str, major: int, minor: int) -> bool:
    return tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) >= (major, minor)


#: ``version_base`` for ``hydra.main`` and ``initialize*``: 1.3's behaviour; 1.4 deprecates
#: the parameter (its defaults are 1.3's), so it is left out there.
VERSION_BASE: dict[str, str] = {} if _at_least(hydra.__version__, 1, 4) else {"version_base": "1.3"}
#: OmegaConf 2.4 renamed ``register_new_resolver`` back to ``register_resolver`` (2.3's
#: ``register_resolver`` is the old, string-only API: never called here).
_NEW_NAME = _at_least(omegaconf.__version__, 2, 4)


def register_resolver(name: str, resolver: Callable[..., Any], use_cache: bool = False) -> None:
    """``${name:...}`` resolved by ``resolver``, once per process (idempotent)."""
    if OmegaConf.has_resolver(name):
        return
    register = OmegaConf.register_resolver if _NEW_NAME else OmegaConf.register_new_resolver
    register(name, resolver, use_cache=use_cache)


def answer_mode(argv: list[str], mode: Any) -> None:
    """Hydra's main composes the whole config only to read ``hydra.mode`` (``get_mode``), then
    again to run it (0.2 s of a start on 2 cores): the preflight check composed this command
    line already, so its ``hydra.mode`` answers for these arguments, and only for them."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import get_args_parser

    args, asked = get_args_parser().parse_known_args(argv)[0], getattr(Hydra, "get_mode", None)
    if asked is not None and args.config_dir is None and args.config_path is None:
        known = (args.config_name or "train", list(args.overrides))  # the check's search path
        Hydra.get_mode = lambda self, config_name, overrides, **more: (  # 1.4: parsed_overrides
            mode
            if (config_name, list(overrides)) == known
            else asked(self, config_name, overrides, **more)
        )
