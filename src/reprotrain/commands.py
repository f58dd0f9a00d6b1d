"""``reprotrain <command>``: one entry point for every job, each with its documented exit code
(docs/cli.md). Nothing heavy is imported until a job runs, so ``--help`` answers at once."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from reprotrain.errors import one_line
from reprotrain.tools import cli


def refuse(message: object) -> int:
    """``error: <message>`` on stderr, one line; the usage exit code to return."""
    print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    return cli.EXIT_USAGE


#: The trainer's codes (reprotrain/train.py's docstring).
TRAIN_CODES = {
    0: "completed",
    2: "refused or failed (one error: line)",
    75: "interrupted after a checkpoint (resume it)",
    130: "aborted by a second Ctrl-C",
}


@dataclass(frozen=True)
class Command:
    """One job: what it does, how it runs, and what each of its exit codes means."""

    name: str
    summary: str
    #: ``module:function`` (under ``reprotrain.``) taking ``argv`` and returning the exit code,
    #: or a callable.
    target: str | Callable[[list[str]], int]
    exit_codes: dict[int, str]

    def meaning(self, code: int) -> str:
        if code in self.exit_codes:
            return self.exit_codes[code]
        if code > 128:
            return f"killed by signal {code - 128}"
        return "see the lines above"

    def run(self, argv: list[str]) -> int:
        target = self.target
        if isinstance(target, str):
            module, _, function = target.partition(":")
            target = getattr(importlib.import_module(f"reprotrain.{module}"), function)
        try:  # the exit code, also of a SystemExit (argparse, --help)
            with cli.prog(f"reprotrain {self.name}"):
                code = target(argv)
        except SystemExit as e:
            code = e.code
            if code is not None and not isinstance(code, int):
                return refuse(code)
        return int(code or 0)


def run_trainer(hydra_args: list[str], nproc_text: str) -> int:
    """The trainer as a child (torchrun above 1 process, the overrides checked once first)."""
    from reprotrain.launchers import run_forwarding_signals, trainer_launcher
    from reprotrain.repro import hashseed

    env = dict(os.environ)
    if not env.get("PYTHONHASHSEED", "random").isdigit():  # what every rank inherits
        env["PYTHONHASHSEED"] = hashseed.FIXED_VALUE
    nproc = 1
    if nproc_text != "1":
        check = "from reprotrain import preflight; preflight.torchrun_cli_check()"
        proc = subprocess.run([sys.executable, "-c", check, nproc_text, *hydra_args], env=env)
        if proc.returncode:
            return proc.returncode
        nproc = int(nproc_text)
    return run_forwarding_signals([*trainer_launcher(nproc), *hydra_args], env)


def train(argv: list[str]) -> int:
    """``reprotrain train [--nproc N] [overrides...]``: ``--help`` is the trainer's."""
    nproc, rest = cli.pop_option(argv, "--nproc", "1")
    return run_trainer(rest, str(nproc))


DEFAULT_SEEDS = "0,1,2"
SEARCH_KEYS = ("hparams_search", "hydra/sweeper")  # and hydra.sweeper.params.*: a search


def sweep_args(argv: Sequence[str]) -> tuple[str, list[str]]:
    """(``--nproc``'s text, the trainer's arguments for ``reprotrain sweep``).

    ``--seeds S`` sweeps ``seed.base`` over S. Without it the basic sweeper sweeps
    ``seed.base=0,1,2`` (``make sweep``'s default); a search (``hydra/sweeper=optuna``,
    ``+hparams_search=...``, ``hydra.sweeper.params...``) or a ``seed.base`` override of
    your own gets no seed list added: a search would take the list for a parameter."""
    nproc, rest = cli.pop_option(argv, "--nproc", "1")
    seeds, args = cli.pop_option(rest, "--seeds", None)
    keys = [a.lstrip("+~").partition("=")[0] for a in args]
    own_seed = "seed.base" in keys
    search = any(k in SEARCH_KEYS or k.startswith("hydra.sweeper.params") for k in keys)
    search = search and "hydra/sweeper=basic" not in args
    if seeds is not None:
        if own_seed:
            raise ValueError(
                "--seeds and a seed.base= override both give the seeds; keep one "
                "(--seeds 0,1,2, or seed.base=0,1,2)"
            )
        if search:
            raise ValueError(
                f"--seeds {seeds} with a search (hydra/sweeper=optuna, +hparams_search=...): "
                "the search would take seed.base for a searched parameter; drop --seeds (a "
                "study's seed is seed.base=N, which also seeds its sampler)"
            )
        check_seed_list(seeds, "--seeds")
    for arg in args:
        if arg.lstrip("+~").partition("=")[0] == "seed.base":
            check_seed_list(arg.partition("=")[2], "seed.base")
    if seeds is None and not own_seed and not search:
        seeds = DEFAULT_SEEDS
    multirun = [] if "--multirun" in args or "-m" in args else ["--multirun"]
    return str(nproc), [*multirun, *([f"seed.base={seeds}"] if seeds else []), *args]


def check_seed_list(text: str, name: str) -> None:
    """A seed list: not empty, no seed twice (one seed counted twice: n=2 with no spread)."""
    values = [v.strip() for v in text.split(",")]
    if not all(values):
        raise ValueError(
            f"{name}={text!r} has an empty seed; give the seeds as a list, e.g. "
            f"{name}=0,1,2 (make sweep SEEDS=0,1,2)"
        )
    numbers = [int(v) if re.fullmatch(r"[+-]?[0-9]+", v) else v for v in values]
    twice = sorted({str(v) for v in numbers if numbers.count(v) > 1})
    if twice:
        raise ValueError(
            f"{name}={text}: seed {twice[0]} is given twice; give each seed once (a repeated "
            "seed is the same run again, not another sample)"
        )


def sweep(argv: list[str]) -> int:
    """``reprotrain sweep [--seeds 0,1,2] [overrides...]``: a Hydra multirun + summary."""
    if argv[:1] in (["-h"], ["--help"]):
        usage = "usage: reprotrain sweep [--seeds S] [--nproc N] [overrides...]"
        print(f"{usage}\n\n{sweep_args.__doc__ or ''}")
        return 0
    try:
        nproc, args = sweep_args(argv)
    except ValueError as e:
        return refuse(e)
    return run_trainer(args, nproc)


def repo_script(name: str, *, interpreter: Sequence[str] | None = None) -> Callable:
    """A job that lives in the repository's ``scripts/`` (not in the installed package)."""

    def run(argv: list[str]) -> int:
        from reprotrain import REPO_ROOT

        path = REPO_ROOT / "scripts" / name
        if not path.is_file():
            return refuse(f"{path} not found: this job runs from a checkout of the repository")
        cmd = [*(interpreter or [sys.executable]), str(path), *argv]
        return subprocess.run(cmd, cwd=REPO_ROOT).returncode

    return run


SHELLS = ("bash", "zsh")  # what Hydra's completion plugins exist for
TRAINER_APP = "reprotrain-train"  # what Hydra's completion query sees in place of "<us> train"
HYDRA_PROGRAM = r"(complete -p |-F hydra_bash_completion )\S+"  # in Hydra's install script


def _trainer_completion(action: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reprotrain.train", "-sc", action]
    env = {**env, "PYTHONHASHSEED": env.get("PYTHONHASHSEED", "0")}
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def shell_completion(argv: list[str]) -> int:
    """``-sc install=bash|zsh`` prints the script; ``-sc query=bash`` answers each <TAB>:
    command names here, ``train``/``sweep`` overrides by Hydra, file names otherwise."""
    action = argv[0] if argv else ""
    shell = action.partition("=")[2]
    if action.startswith(("install=", "uninstall=", "query=")) and shell not in SHELLS:
        fix = f"-sc {action.partition('=')[0]}=bash or =zsh"
        return refuse(f"-sc {action}: completion exists for bash and zsh only; {fix}")
    if action.startswith(("install=", "uninstall=")):
        proc = _trainer_completion(action, dict(os.environ))
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        # Hydra names the program it was started as; the script is for this command.
        sys.stdout.write(re.sub(HYDRA_PROGRAM, r"\1reprotrain", proc.stdout))
        return 0
    if not action.startswith("query="):
        return refuse("-sc install=bash | install=zsh | uninstall=bash | query=bash")
    line = os.environ.get("COMP_LINE", "")
    point = int(os.environ.get("COMP_POINT", len(line)) or len(line))
    words, new_word = line[:point].split(), line[:point][-1:].isspace()
    if len(words) == 1 or (len(words) == 2 and not new_word):
        prefix = words[1] if len(words) == 2 else ""
        print(" ".join(name for name in COMMANDS if name.startswith(prefix)))
        return 0
    if words[1] not in ("train", "sweep"):
        return 0  # file names: the shell's default completion
    cut = line.index(words[1], len(words[0])) + len(words[1])
    point += len(TRAINER_APP) - cut
    env = dict(os.environ, COMP_LINE=TRAINER_APP + line[cut:], COMP_POINT=str(point))
    proc = _trainer_completion(action, env)
    print(proc.stdout, end="")
    return proc.returncode


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in (
        Command("train", "one run: reprotrain train experiment=smoke [--nproc N]", train,
            TRAIN_CODES),
        Command("sweep", "a Hydra multirun (seeds, or hydra/sweeper=optuna) + summary", sweep,
            TRAIN_CODES),
        Command("resume", "continue an interrupted run in place: reprotrain resume RUN_DIR",
            "tools.runs.resume:main", TRAIN_CODES),
        Command("verify", "the same config twice in fresh processes; 0 only if bitwise equal",
            "tools.runs.verify:main", {0: "IDENTICAL", 1: "DIVERGED", 2: "refused or failed"}),
        Command("eval", "evaluate a run's checkpoint on the test split",
            "tools.runs.eval:main", {0: "evaluated", 2: "error"}),
        Command("report", "write report.md + curves.png into a run directory",
            "run.report:main", {0: "written", 2: "error"}),
        Command("summary", "(re)write a sweep's summary.json/.md/.png",
            "tools.sweeps.sweep_summary:main", {0: "written", 1: "no completed run", 2: "error"}),
        Command("archive", "pack a run or a whole sweep into a verifiable archive",
            "tools.archive.archive:main", {0: "written", 2: "refused"}),
        Command("reproduce", "replay an archive and compare", "tools.reproduce.reproduce:main",
            {0: "REPRODUCED or CONSISTENT", 1: "DIVERGED or INCONSISTENT", 2: "refused",
             3: "NOT COMPARABLE or INCONCLUSIVE", 4: "the re-run failed"}),
        Command("bisect", "first divergent step, then the first divergent op and module",
            "tools.debugging.bisect:main", {0: "identical", 1: "DIVERGED", 2: "error"}),
        Command("compare", "statistical verdict between two sweeps",
            "tools.sweeps.compare_sweeps:main",
            {0: "CONSISTENT", 1: "INCONSISTENT", 2: "error", 3: "INCONCLUSIVE"}),
        Command("check-lock", "validate the hashed locks offline",
            "tools.locks.check_lock:main", {0: "ok", 1: "a problem"}),
        Command("env-check", "compare the installed environment with the locks",
            "tools.locks.env_check:main", {0: "ok", 1: "drift"}),
        Command("new-project", "a fresh repository from this template: NAME DEST",
            "tools.template.new_project:main", {0: "created", 1: "conflict", 2: "bad input"}),
        Command("update-template", "in a project: merge the template's framework fixes",
            "tools.template.update_template:main", {0: "merged", 1: "conflict", 2: "bad input"}),
        Command("drill", "preemption drill: SIGKILL, resume, demand identical bits",
            repo_script("kill_resume_trials.py"),
            {0: "every trial identical", 1: "a trial differed", 2: "error"}),
        Command("bench", "side-by-side ratios -> outputs/bench/<stamp>/bench.md",
            repo_script("bench.py"), {0: "written", 1: "a measured run failed", 2: "error"}),
        Command("gpu-check", "one-shot GPU check (one JSON)",
            repo_script("gpu_check.sh", interpreter=["bash"]),
            {0: "ok", 2: "no usable GPU or error"}),
    )
}  # fmt: skip


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: reprotrain [--exit-file PATH] [--exit-line] <command> [args...]",
        "       reprotrain -sc install=bash   (shell completion: eval its output)",
        "",
        "commands (reprotrain <command> --help for each; exit codes after the colon):",
    ]
    for c in COMMANDS.values():
        codes = "; ".join(f"{k} {v}" for k, v in c.exit_codes.items())
        lines.append(f"  {c.name:<{width}}  {c.summary}")
        lines.append(f"  {'':<{width}}    exit: {codes}")
    lines += [
        "",
        "options (before the command; what the Make targets pass):",
        "  --exit-file PATH  write the command's exit code (0 too) to PATH, one line",
        "  --exit-line       on a non-zero exit, one stderr line: reprotrain <cmd>: exit N (...)",
        "  --args TEXT       append TEXT's words to the command's arguments (make's ARGS): split",
        "                    as the shell would, quotes kept, nothing expanded or run",
        "",
        "make exits 2 whenever a recipe fails: scripts and CI call `reprotrain <command>`",
        "directly, or read EXIT_FILE (make compare A=.. B=.. EXIT_FILE=rc.txt). See docs/cli.md.",
    ]
    return "\n".join(lines)


def split_args(text: str) -> list[str]:
    """``--args TEXT`` (Make's ``ARGS``) split as the shell would, quotes kept, never expanded."""
    import shlex

    try:
        return shlex.split(text)
    except ValueError as e:
        hint = "quote a whole value, e.g. ARGS=\"name='a b'\""
        raise ValueError(f"ARGS={text}: {e}; {hint}") from None


#: Commands that read a run directory but parse no trust options: ``--trust`` is read here and
#: an archived run is refused unless a trust rule holds (eval, bisect, resume decide themselves).
GATED = ("report", "compare", "train")


def _gated(command: Command, argv: list[str]) -> int:
    """``command.run(argv)``, after the archive trust decision for a gated command."""
    train, resumes = command.name == "train", [a for a in argv if a.startswith("resume=")]
    if command.name not in GATED or argv[:1] in (["-h"], ["--help"]) or (train and not resumes):
        return command.run(argv)  # train: a fresh run builds its own composed config
    from reprotrain.errors import ReprotrainError
    from reprotrain.tools.reproduce import run_trust

    trust, signers, argv = run_trust.pop_arguments(argv)
    try:  # train: only the checkpoint it resumes is the run's
        run_trust.require_trust(run_trust.paths_in(resumes if train else argv), trust, signers)
    except ReprotrainError as e:
        refuse(e)
        return e.exit_code
    return command.run(argv)


def _options(argv: list[str]) -> tuple[Path | None, bool, list[str]]:
    exit_file, exit_line, extra = None, False, []
    while argv and argv[0].startswith(("--exit-", "--args")):
        arg = argv.pop(0)
        if arg == "--exit-line":
            exit_line = True
        elif arg == "--exit-file" and argv:
            exit_file = Path(argv.pop(0)).expanduser()
        elif arg.startswith("--exit-file="):
            exit_file = Path(arg.partition("=")[2]).expanduser()
        elif arg == "--args" and argv:
            extra += split_args(argv.pop(0))
        elif arg.startswith("--args="):
            extra += split_args(arg.partition("=")[2])
        else:
            raise ValueError(f"{arg}: unknown option (see reprotrain --help)")
    return exit_file, exit_line, [*argv, *extra]


def main(argv: list[str] | None = None) -> int:
    """The ``reprotrain`` console script: dispatch to a job; return the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        exit_file, exit_line, argv = _options(argv)
    except ValueError as e:
        return refuse(e)
    if exit_file is not None:
        from reprotrain.tools import exit_file as exit_files

        try:  # before the job runs: a device, FIFO or directory is never replaced
            exit_file = exit_files.checked(exit_file)
        except exit_files.ExitFileError as e:
            return refuse(e)
    if argv[:1] in (["-sc"], ["--shell-completion"]):
        return shell_completion(argv[1:])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        code = 0 if argv else cli.EXIT_USAGE
    elif argv[0] == "--version":
        from reprotrain import __version__

        print(f"reprotrain {__version__}")
        code = 0
    elif argv[0] not in COMMANDS:
        known = f"one of: {', '.join(COMMANDS)} (reprotrain --help)"
        code = refuse(f"{argv[0]!r} is not a reprotrain command; {known}")
    else:
        command = COMMANDS[argv[0]]
        code = _gated(command, argv[1:])
        if code and exit_line:
            meaning = f"exit {code} ({command.meaning(code)})"
            print(f"reprotrain {command.name}: {meaning}", file=sys.stderr, flush=True)
    if exit_file is not None:
        exit_files.write(exit_file, code)  # a failed write is one line; the code survives
    return code


if __name__ == "__main__":
    sys.exit(main())
