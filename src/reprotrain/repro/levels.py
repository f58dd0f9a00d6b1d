"""What each ``repro.level`` means, in one place: the controls it sets and what it refuses
rather than records (docs/configuration.md, "Determinism levels"; docs/randomness.md). Every
other module asks the ``Level``; none compares level names, so two modules cannot disagree
about a level again (``data/purity.py`` refused impure samples under portable while
``resume/guard.py`` let an unrestorable resume through). ``portable`` is ``strict`` plus
pinned CPU dispatch, built from it, so it refuses all that strict refuses."""

from dataclasses import dataclass, replace

from reprotrain.errors import ReprotrainError


@dataclass(frozen=True)
class Level:
    """One level. The flags torch reports after applying it are what ``run.json`` records."""

    name: str
    # torch's deterministic algorithms, cuDNN deterministic without benchmark, NaN-filled
    # fresh memory: off, only the seeds hold (``fast``), and no identical bits are promised.
    deterministic: bool = False
    # a nondeterministic op is warned and listed in run.json (``nondeterministic_ops``), not
    # raised: the bits are promised only while that list is empty.
    warn_only: bool = False
    # the x86-64-wide CPU code paths, set at interpreter start (``hashseed``) and read back.
    pins_cpu_dispatch: bool = False
    # refused in one line rather than warned and recorded as not promising the bits:
    refuses_impure_samples: bool = False  # a sample that is not a function of its key
    refuses_unrestorable_resume: bool = False  # state no checkpoint holds (resume/guard.py)


STRICT = Level(
    "strict", deterministic=True, refuses_impure_samples=True, refuses_unrestorable_resume=True
)
WARN = Level("warn", deterministic=True, warn_only=True)
FAST = Level("fast")
PORTABLE = replace(STRICT, name="portable", pins_cpu_dispatch=True)
LEVELS = {known.name: known for known in (STRICT, WARN, FAST, PORTABLE)}  # the config's order


def level(name: str) -> Level:
    """The level ``name`` names; an unknown name is refused in one line."""
    if name not in LEVELS:
        raise ReprotrainError(f"unknown repro level {name!r}: use one of {', '.join(LEVELS)}")
    return LEVELS[name]
