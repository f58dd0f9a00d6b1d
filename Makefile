# reprotrain — every target takes Hydra overrides through ARGS="...".
# `make train` and `make test` build .venv from the hashed locks first when needed.

# The settings are the variables this file gives a default with `?=` (read from its text: one
# list, never a second). Any other name given on the command line, a typo (ARG=) or one of the
# Makefile's own definitions (VENV, q, BASE_DIGEST, MAKE, CURDIR...), is refused before
# anything runs: Make lets such a variable replace the definition, code included, and expands
# it even under `make -n` (`make -n docker-build 'BASE_DIGEST=$(shell ...)'` ran it). The
# gate reads no variable a command line could replace (MAKEFILE_LIST only when Make set it),
# and its shell is /bin/sh whatever SHELL or .SHELLFLAGS a command line gave (refused too).
override COMMAND_LINE := $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v)))
override SHELL := /bin/sh
override .SHELLFLAGS := -c
override SETTINGS_FILE := $(if $(filter file,$(origin MAKEFILE_LIST)),$(lastword $(MAKEFILE_LIST)),Makefile)
override SETTINGS := $(shell sed -n 's/^\(export \)\{0,1\}\([A-Za-z_][A-Za-z0-9_]*\) *?=.*/\2/p' '$(SETTINGS_FILE)')
override NOT_SETTINGS := $(filter-out $(SETTINGS),$(COMMAND_LINE))
$(if $(NOT_SETTINGS),$(error error: not a setting of this Makefile (a typo?): $(NOT_SETTINGS); the settings: $(SETTINGS)))

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=
SEEDS  ?= 0,1,2
RUN    ?=
ARCHIVE ?=
# make bisect / make compare: two run (or sweep) directories; MARGIN and MODE: see "When bits differ".
A      ?=
B      ?=
MARGIN ?=
MODE   ?=
EPOCHS ?=
PKG    ?=
# Trust and signing for archives (see docs: "What is and is not guaranteed").
SIGN            ?=
TRUSTED_SIGNERS ?=
TRUST           ?=
# Read by one target each (see its `make help` line): NPROC_B, KILL (verify), CKPT (eval), TOL
# (reproduce), METRIC (reproduce, compare), WITH_CKPT, ALLOW_INCOMPLETE (archive),
# ALLOW_DATA_DRIFT (reproduce), TRIALS (drill), NAME, DEST (new-project).
NPROC_B ?=
KILL ?=
CKPT ?=
TOL ?=
METRIC ?=
WITH_CKPT ?=
ALLOW_INCOMPLETE ?=
ALLOW_DATA_DRIFT ?=
TRIALS ?=
NAME ?=
DEST ?=

# A variable given on the command line is exported to every recipe's environment, which
# makes Make expand it (a `$(shell ...)` in it would run): none is; recipes pass each one as
# an argument, quoted with q. (PYTHONHASHSEED, exported below as its typed text, is the one
# variable exported.)
unexport $(COMMAND_LINE)

# A variable's text, single-quoted for the shell and never expanded by Make or the shell:
# `make resume "RUN=/tmp/x;touch /tmp/PWNED"` passes that string as one argument, inert, and
# so does `make eval 'CKPT=$(shell touch C)'` ($(value ...): Make never expands it either).
# A newline (which would end the recipe line) travels as "$RT_NEWLINE", a newline.
q = '$(subst $(NL),'"$$RT_NEWLINE"',$(subst ','\'',$(value $(1))))'
# ARGS is a list of overrides: `reprotrain --args TEXT` splits TEXT into words as the shell
# would (quotes kept, src/reprotrain/commands.py), but never expands or runs any of it.

# A switch, read as people write it: 1/yes/true/on (any case shown) is on, 0/no/false/off or
# empty is off, anything else is one error: line (exit 2) before the job runs. Every switch
# (KILL, WITH_CKPT, ALLOW_INCOMPLETE, ALLOW_DATA_DRIFT, TRUST) goes through these two:
#   $(call on,KILL)            -> 1 when KILL is on, empty otherwise
#   $(call check_switches,A B) -> a recipe line refusing a value that is neither
SWITCH_ON  := 1 yes true on Yes True On YES TRUE ON y Y
SWITCH_OFF := 0 no false off No False Off NO FALSE OFF n N
switch_text = $(strip $(value $(1)))
on = $(if $(filter $(SWITCH_ON),$(call switch_text,$(1))),1)
switch_bad = $(or $(word 2,$(call switch_text,$(1))),$(filter-out $(SWITCH_ON) $(SWITCH_OFF),$(call switch_text,$(1))))
check_switches = @$(foreach v,$(1),$(if $(call switch_bad,$(v)),printf 'error: %s=%s is not a switch; write %s=1 (or yes/true/on) to turn it on; %s=0 (or no/false/off) or nothing leaves it off\n' $(v) $(call q,$(v)) $(v) $(v) >&2; exit 2;)) :

# ARGS is split into words (quotes kept); a quote left open in it cannot be split. `sh -n`
# parses the text (never runs it): an unbalanced ARGS is one error: line before the job.
check_args = @$(SHELL) -nc ': '$(call q,ARGS) 2>/dev/null || { printf 'error: ARGS=%s has a quote that is not closed; quote a whole value, e.g. ARGS="name=\047a b\047"\n' $(call q,ARGS) >&2; exit 2; }

# Hash randomisation is fixed at interpreter start; the entry point also re-execs itself
# when this is missing, so plain `python -m reprotrain.train` is covered too. A value of
# your own (`PYTHONHASHSEED=123 make train`) is kept and recorded in run.json.
# Yours is kept as typed: a simple variable holding its text, exported without expansion.
# given: a variable typed on the command line or taken from the environment.
given = $(filter command line environment,$(origin $(1)))
ifneq ($(call given,PYTHONHASHSEED),)
override PYTHONHASHSEED := $(value PYTHONHASHSEED)
endif
export PYTHONHASHSEED ?= 0
# Must be set before the first CUDA call (cuBLAS reads it once).
export CUBLAS_WORKSPACE_CONFIG := :4096:8

.DEFAULT_GOAL := help
.PHONY: help install train test test-skipped test-slow lint format verify sweep resume archive reproduce \
        lock upgrade check-lock env-check pin-base docker-base docker-build docker-train docker-test \
        bench gpu-check portable-probe drill new-project update-template report eval clean bisect compare \
        docs docs-serve docs-check docs-images selfcheck

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

# The stamp is newer than both locks and pyproject.toml once the venv matches them, so an
# unchanged lock installs nothing. A failed install leaves no stamp (and is retried).
$(STAMP): requirements.lock requirements-dev.lock pyproject.toml
	test -x $(PY) || $(call q,PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r requirements.lock -r requirements-dev.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# Optional extras, hashed and locked like the rest: make install EXTRAS=mlflow,wandb (the
# loggers; docs/loggers.md). Each is requirements-<extra>.lock; with them, no drift.
EXTRAS ?=
KNOWN_EXTRAS := $(patsubst requirements-%.in,%,$(filter-out requirements-dev.in,$(wildcard requirements-*.in)))
comma := ,
EXTRA_NAMES = $(strip $(subst $(comma), ,$(value EXTRAS)))

install: $(STAMP) ## build .venv from the hashed locks (no-op when unchanged) [EXTRAS=mlflow,wandb]
ifneq ($(EXTRA_NAMES),)
	@test -z $(if $(filter-out $(KNOWN_EXTRAS),$(EXTRA_NAMES)),x) || { printf 'error: unknown extra in EXTRAS=%s; choose from: $(KNOWN_EXTRAS)\n' $(call q,EXTRAS) >&2; exit 2; }
	$(PY) -m pip install --quiet --require-hashes --no-deps $(foreach e,$(filter $(KNOWN_EXTRAS),$(EXTRA_NAMES)),-r requirements-$(e).lock)
endif

NPROC  ?= 1
# Every job below is `reprotrain <command>` (src/reprotrain/commands.py; `reprotrain --help`).
# make exits 2 whenever a recipe fails, whatever the job's own code was; the code is kept:
# a failing job prints one stderr line `reprotrain <command>: exit N (<meaning>)`, and
# EXIT_FILE=<path> receives it (0 too). Scripts and CI call `reprotrain <command>` directly.
# `make train NPROC=N`: the same run under torchrun DDP (gloo on CPU, nccl on CUDA); the
# overrides are checked once before torchrun starts, so a typo is one line, not N. SIGUSR2
# (SLURM's warning) reaches the workers like SIGTERM/SIGINT, with time to checkpoint.
EXIT_FILE ?=
RT = $(VENV)/bin/reprotrain --exit-line $(if $(value EXIT_FILE),--exit-file $(call q,EXIT_FILE)) $(if $(value ARGS),--args $(call q,ARGS))
# A run directory that came from an archive is built only under a trust rule (docs:
# archive-and-reproduce.md, "Runs from an archive"): TRUST=1 or TRUSTED_SIGNERS=<file>.
TRUST_ARGS = $(if $(call on,TRUST),--trust) $(if $(value TRUSTED_SIGNERS),--trusted-signers $(call q,TRUSTED_SIGNERS))
# A command that is not `reprotrain`, with ARGS split the same way (never expanded).
WITH_ARGS = $(PY_ANY) -c 'import os, shlex, sys; os.execvp(sys.argv[2], sys.argv[2:] + shlex.split(sys.argv[1]))' $(call q,ARGS)

train: $(STAMP) ## one run: make train ARGS="experiment=smoke [task=mixup] [trainer.microbatch_size=32]" [NPROC=2: torchrun DDP]
	$(check_args)
	$(RT) train --nproc $(call q,NPROC)

# The default tier is mostly process start-up on one core each: one pytest worker per core
# (pytest-xdist), a test file's tests kept together so its fixtures train once. The slowest
# 15 tests are printed, so a regression shows; the tests skipped for a missing extra or
# binary are listed in SKIPPED_FOR_INSTALLS, for `make test-skipped` once they are installed.
# (The list comes from the template's tests/skip_policy.py; a new project's tests have none.)
SKIPPED_FOR_INSTALLS := build/tests/skipped-for-installs.txt
SKIPPED_TO = $(if $(wildcard tests/skip_policy.py),--skipped-to=$(SKIPPED_FOR_INSTALLS))
test: $(STAMP) ## the test suite (CPU, offline), without the slow marker, on every core
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadfile --durations=15 $(SKIPPED_TO)

test-skipped: $(STAMP) ## run again the tests `make test` skipped for a missing extra or binary (after installing them)
	@test -f $(SKIPPED_FOR_INSTALLS) || { echo "error: no $(SKIPPED_FOR_INSTALLS); run make test first" >&2; exit 2; }
	@if [ -s $(SKIPPED_FOR_INSTALLS) ]; then $(PY) -m pytest -q -m "not slow" -n auto --dist loadfile @$(SKIPPED_FOR_INSTALLS); else echo "make test skipped nothing for a missing extra or binary"; fi

# The slow tier starts every process cold (tests/warm.py): the default tier's warm children
# are checked against real processes by tests/test_warm.py, and CI runs both tiers.
test-slow: $(STAMP) ## the slow tests only: DDP layouts, launcher sweeps (CI runs both), on every core
	REPROTRAIN_TEST_COLD=1 $(PY) -m pytest -q -m slow -n auto --dist loadfile --durations=15

lint: $(STAMP) ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP) ## ruff autofix + format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The docs site (mkdocs-material, in the dev lock): docs/ + mkdocs.yml -> build/site/.
DOCS_ADDR ?= 127.0.0.1:8000
docs: $(STAMP) ## build the docs site into build/site/ (mkdocs build --strict: a broken link fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: $(STAMP) ## serve the docs site with live reload: make docs-serve [DOCS_ADDR=127.0.0.1:8000]
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict --dev-addr $(call q,DOCS_ADDR)

docs-images: $(STAMP) ## redraw docs/img/*.png with the current plot code from the records in docs/img/src/
	$(call in_template,scripts/docs_images.py)
	$(PY) scripts/docs_images.py

docs-check: docs ## the built site in a headless browser: every image loads, every link resolves (CI)
	$(PY) scripts/docs_browser_check.py build/site

verify: $(STAMP) ## same config twice in fresh processes; exit 0 only if bitwise identical [NPROC=N] [NPROC_B=M: invariant runs] [KILL=1: b SIGKILLed + resumed]
	$(call check_switches,KILL)
	$(RT) verify --nproc $(call q,NPROC) $(if $(value NPROC_B),--nproc-b $(call q,NPROC_B)) $(if $(call on,KILL),--kill)

sweep: $(STAMP) ## Hydra multirun over seed.base=$(SEEDS) + summary.json/.md/.png [ARGS="hydra/sweeper=optuna ...": a seeded search]
	$(check_args)
	$(RT) sweep $(if $(filter command line environment,$(origin SEEDS)),--seeds $(call q,SEEDS))

resume: $(STAMP) ## continue an interrupted run in place (its world size; invariant runs: any NPROC dividing k): make resume RUN=outputs/...
	@test -n $(call q,RUN) || { echo "error: give the run directory: make resume RUN=outputs/<run>" >&2; exit 2; }
	$(call check_switches,TRUST)
	$(RT) resume $(call q,RUN) $(if $(filter command line,$(origin NPROC)),--nproc $(call q,NPROC)) $(TRUST_ARGS)

archive: $(STAMP) ## pack a run or a whole sweep: make archive RUN=outputs/...|multirun/... [WITH_CKPT=1] [ALLOW_INCOMPLETE=1] [SIGN=~/.ssh/id_ed25519]
	@test -n $(call q,RUN) || { echo "error: give the run directory: make archive RUN=outputs/<run>" >&2; exit 2; }
	$(call check_switches,WITH_CKPT ALLOW_INCOMPLETE)
	$(RT) archive $(call q,RUN) $(if $(call on,WITH_CKPT),--with-checkpoint) $(if $(call on,ALLOW_INCOMPLETE),--allow-incomplete) $(if $(value SIGN),--sign $(call q,SIGN))

reproduce: $(STAMP) ## replay an archive and compare: make reproduce ARCHIVE=archives/x.tar.gz [EPOCHS=1] [TOL=0.02] [ALLOW_DATA_DRIFT=1] [TRUSTED_SIGNERS=file] [TRUST=1] [MODE=statistical MARGIN=x]
	@test -n $(call q,ARCHIVE) || { echo "error: give the archive: make reproduce ARCHIVE=archives/<file>.tar.gz" >&2; exit 2; }
	$(call check_switches,ALLOW_DATA_DRIFT TRUST)
	$(RT) reproduce $(call q,ARCHIVE) $(if $(value EPOCHS),--epochs $(call q,EPOCHS)) $(if $(value TOL),--tolerance $(call q,TOL)) $(if $(call on,ALLOW_DATA_DRIFT),--allow-data-drift) $(if $(value TRUSTED_SIGNERS),--trusted-signers $(call q,TRUSTED_SIGNERS)) $(if $(call on,TRUST),--trust) $(if $(value MODE),--mode $(call q,MODE)) $(if $(value MARGIN),--margin $(call q,MARGIN)) $(if $(value METRIC),--metric $(call q,METRIC))

bisect: $(STAMP) ## first divergent step, then op and module: make bisect A=<run dir> B=<run dir>
	@test -n $(call q,A) -a -n $(call q,B) || { echo "error: give two run directories: make bisect A=<run> B=<run>" >&2; exit 2; }
	$(call check_switches,TRUST)
	$(RT) bisect $(call q,A) $(call q,B) $(TRUST_ARGS)

compare: $(STAMP) ## statistical verdict between two sweeps: make compare A=<sweep> B=<sweep> [MARGIN=x] [METRIC=val_acc]
	@test -n $(call q,A) -a -n $(call q,B) || { echo "error: give two sweep directories: make compare A=<sweep> B=<sweep>" >&2; exit 2; }
	$(call check_switches,TRUST)
	$(RT) compare $(call q,A) $(call q,B) $(if $(value MARGIN),--margin $(call q,MARGIN)) $(if $(value METRIC),--metric $(call q,METRIC)) $(TRUST_ARGS)

# The framework's own benchmarks, drills and GPU check live in the template, not in a project
# made from it (docs/project-layout.md): there, the target says so in one line.
in_template = @test -e $(1) || { echo "error: make $@ lives in the reprotrain template ($(1) is not in a project); run it in a checkout of the template (make selfcheck checks the framework here)" >&2; exit 2; }

selfcheck: $(STAMP) ## the framework checks itself here: its own tiny job twice, one SIGKILLed + resumed, bitwise identical
	$(check_args)
	$(WITH_ARGS) $(PY) -m reprotrain.selfcheck

gpu-check: ## one-shot GPU check (one JSON); fails in one line without CUDA
	$(call in_template,scripts/gpu_check.sh)
	$(check_args)
	$(WITH_ARGS) bash scripts/gpu_check.sh

report: $(STAMP) ## write report.md + curves.png into a run dir: make report RUN=outputs/...
	@test -n $(call q,RUN) || { echo "error: give the run directory: make report RUN=outputs/<run>" >&2; exit 2; }
	$(call check_switches,TRUST)
	$(RT) report $(call q,RUN) $(TRUST_ARGS)

eval: $(STAMP) ## evaluate a checkpoint on the test split: make eval RUN=outputs/... [CKPT=last|best|path]
	@test -n $(call q,RUN) || { echo "error: give the run directory: make eval RUN=outputs/<run>" >&2; exit 2; }
	$(check_args)
	$(call check_switches,TRUST)
	$(RT) eval $(call q,RUN) --checkpoint $(if $(value CKPT),$(call q,CKPT),last) $(TRUST_ARGS)

bench: ## side-by-side ratios -> outputs/bench/<stamp>/bench.md (ARGS="--full" | "--device cuda")
	$(call in_template,scripts/bench.py)
	@$(MAKE) --no-print-directory install
	$(RT) bench

# repro=portable's claim on CPUs nobody here has: the probe natively and under qemu-user
# (Debian: apt-get install qemu-user) as each of CPUS; a CPU without AVX2 must be refused.
CPUS ?= Haswell-v4,EPYC-Rome-v2
portable-probe: $(STAMP) ## repro=portable's bits natively and on emulated CPUs (qemu-user) vs the pin [CPUS=Haswell-v4,EPYC-Rome-v2]
	$(call in_template,scripts/portable_probe.py)
	$(check_args)
	$(WITH_ARGS) $(PY) scripts/portable_probe.py --cpus $(call q,CPUS)

drill: ## preemption drill: SIGKILL a self-check run at TRIALS (>=1) random moments, resume, compare [NPROC=2]
	$(call in_template,scripts/kill_resume_trials.py)
	@$(MAKE) --no-print-directory install
	$(RT) drill --trials $(if $(value TRIALS),$(call q,TRIALS),5) --nproc $(call q,NPROC)

new-project: ## a fresh repository from this template: make new-project NAME=mylab DEST=../mylab
	@test -n $(call q,NAME) -a -n $(call q,DEST) || { echo "error: make new-project NAME=<package> DEST=<new dir>" >&2; exit 2; }
	@$(call q,PYTHON) src/reprotrain/tools/template/new_project.py $(call q,NAME) $(call q,DEST)

TEMPLATE ?=
update-template: ## in a project: merge the template's framework fixes since .template.json's commit [TEMPLATE=path|url]
	@$(call q,PYTHON) src/reprotrain/tools/template/update_template.py $(if $(value TEMPLATE),--template $(call q,TEMPLATE))

clean: ## remove outputs (keeps .venv and data/)
	rm -rf outputs multirun archives tb .pytest_cache .ruff_cache

# ============================================================================================
# Environment: locks, drift, container (issue 5). Nothing below reaches the network except
# lock / upgrade (uv pip compile + the index's file lists), pin-base (registry) and docker-*.
# ============================================================================================

# check-lock needs only the standard library: it runs before any venv exists.
PY_ANY = $(if $(wildcard $(PY)),$(PY),$(call q,PYTHON))
# One universal lock for every platform (markers keep the CUDA wheels on Linux), every file of
# each release hashed, for CPython 3.11 and newer. uv (dev lock) compiles; plain pip installs.
# It writes no index URL or find-links unless asked, and prefers the pins already in -o.
UV_COMPILE = $(VENV)/bin/uv pip compile --quiet --universal --generate-hashes \
             --python-version 3.11 --custom-compile-command "make lock"
# .sha256: what each lock was compiled from; .files: which file each hash is (from the index).
RECORD_LOCKS = PYTHONPATH=src $(PY_ANY) -m reprotrain.tools.locks.check_lock --record --record-files

# ---- The container (docs/container.md): Docker or Podman, whichever is installed.
# The engine: ENGINE=docker or ENGINE=podman (the name, never a path). Unset: docker when its
# daemon answers, else podman when installed, else docker (whose own error then says what is
# missing); probed once, by a container target only. Each container target prints its choice.
ENGINE ?=
ENGINES := docker podman
engine_text = $(strip $(value ENGINE))
ENGINE_AUTO = $(eval ENGINE_AUTO := $$(shell docker info >/dev/null 2>&1 && echo docker || { command -v podman >/dev/null && echo podman || echo docker; }))$(ENGINE_AUTO)
# One of the two names (a given ENGINE that is neither is empty here, refused by check_engine).
E = $(if $(call given,ENGINE),$(if $(filter 1,$(words $(engine_text))),$(filter $(ENGINES),$(engine_text))),$(ENGINE_AUTO))
check_engine = @$(if $(E),echo "engine: $(E) ($(if $(call given,ENGINE),ENGINE=$(E),ENGINE unset: docker if its daemon answers$(comma) else podman if installed))",printf 'error: ENGINE=%s: write ENGINE=docker or ENGINE=podman\n' $(call q,ENGINE) >&2; exit 2)

# The base image (tag, and digest once `make pin-base` ran) lives in one file, read with sed,
# not `include` (that would add the file to MAKEFILE_LIST, which `help` greps). BASE_REF=<image>
# builds on another base instead: where no registry is reachable, the Debian one that
# `make docker-base` builds from the Debian archive (DEBIAN_MIRROR) as BASE_NAME.
BASE_IMAGE  := $(shell sed -n 's/^BASE_IMAGE=//p' docker/base-image.env 2>/dev/null)
BASE_DIGEST := $(shell sed -n 's/^BASE_DIGEST=//p' docker/base-image.env 2>/dev/null)
PINNED_BASE := $(BASE_IMAGE)$(if $(BASE_DIGEST),@$(BASE_DIGEST))
BASE_REF ?=
BASE_NAME ?= localhost/reprotrain-base:bookworm
DEBIAN_MIRROR ?= http://deb.debian.org/debian
# The variable holding the base this build uses (quoted with q wherever it goes).
base_var = $(if $(value BASE_REF),BASE_REF,PINNED_BASE)
GIT_SHORT    = $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo nogit)$(shell git diff --quiet HEAD -- 2>/dev/null || echo -dirty)
LOCK_SHORT   = $(shell $(PY_ANY) -c "import hashlib;print(hashlib.sha256(open('requirements.lock','rb').read()).hexdigest()[:12])")
IMAGE       ?= reprotrain:$(GIT_SHORT)-$(LOCK_SHORT)
# IMAGE, BASE_REF, BASE_NAME, DEBIAN_MIRROR and GPUS as given (command line or environment) are
# text, never expanded, quoted, and hold only what the engine takes (check_docker_names, first
# in each container recipe).
IMAGE_NAME   = $(if $(call given,IMAGE),$(call q,IMAGE),$(IMAGE))
only_chars   = $(if $(call given,$(1)),test -z "$$(printf '%s' $(call q,$(1)) | LC_ALL=C tr -d '$(2)')" || { printf 'error: %s=%s: use only letters$(comma) digits and %s\n' $(1) $(call q,$(1)) '$(subst A-Za-z0-9,,$(2))' >&2; exit 2; };)
IMAGE_CHARS := A-Za-z0-9./_:@-
check_docker_names = @$(foreach v,IMAGE BASE_REF BASE_NAME,$(call only_chars,$(v),$(IMAGE_CHARS))) $(call only_chars,DEBIAN_MIRROR,A-Za-z0-9./_:@~+-) $(call only_chars,GPUS,A-Za-z0-9=$(comma):._-) :
# docker-train's GPUs. Unset: one GPU (--gpus device=0, what a single-process run uses) when
# `docker info` lists the nvidia runtime, none otherwise (and none by default under podman).
# GPUS=all | GPUS=2 | GPUS=device=0,1 go to --gpus, in the inner quotes docker needs for a
# list; GPUS=none: no GPU; GPUS=cdi (all) or GPUS=cdi:0 use the Container Device Interface
# (--device nvidia.com/gpu=...), for hosts set up with CDI instead of the nvidia runtime (and
# podman). SHM sizes /dev/shm: DataLoader workers pass batches through it (docker's default 64m
# ends in a bus error).
GPUS        ?=
SHM         ?= 2g
DOCKER_NVIDIA = $(if $(filter docker,$(E)),$(shell docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q nvidia && echo yes))
GPUS_TEXT    = $(value GPUS)
DOCKER_GPUS  = $(strip $(if $(GPUS_TEXT),\
                 $(if $(filter none,$(GPUS_TEXT)),,\
                 $(if $(filter cdi,$(GPUS_TEXT)),--device nvidia.com/gpu=all,\
                 $(if $(filter cdi:%,$(GPUS_TEXT)),--device nvidia.com/gpu=$(patsubst cdi:%,%,$(GPUS_TEXT)),\
                 --gpus '"$(GPUS_TEXT)"'))),\
                 $(if $(DOCKER_NVIDIA),--gpus device=0)))
# Behind a TLS-inspecting proxy the build's pip must trust its CA: CA_BUNDLE=<file> (default:
# pip's own $PIP_CERT, when set) goes in as the build secret ca_bundle, never into a layer.
CA_BUNDLE   ?=
# The base's identity for run.json: its image ID when the engine holds it, else the pinned digest.
# $(1): the stage, $(2): the tag (quoted).
build_image = base_id=$$($(E) image inspect --format '{{.Id}}' $(call q,$(base_var)) 2>/dev/null || true); \
	$(if $(value BASE_REF),,[ -n "$$base_id" ] || base_id=$(call q,BASE_DIGEST);) \
	ca=$(if $(value CA_BUNDLE),$(call q,CA_BUNDLE),"$${PIP_CERT:-}"); \
	$(E) build --build-arg BASE_REF=$(call q,$(base_var)) --build-arg BASE_ID="$$base_id" \
	--build-arg IMAGE_TAG=$(2) --build-arg GIT_COMMIT=$(GIT_SHORT) $${ca:+--secret "id=ca_bundle,src=$$ca"} \
	--target $(1) -t $(2) .
# What an image cannot know about itself, given at start for run.json: its ID and the engine.
run_identity = -e REPROTRAIN_IMAGE_ID="$$($(E) image inspect --format '{{.Id}}' $(1))" -e REPROTRAIN_ENGINE="$$($(E) --version)"

# One recipe line per extra lock (in order: each .in is constrained by the locks before it).
define NL


endef
# q's newline: the recipe's shell reads it from the environment (a line break in a recipe
# line would end it).
export RT_NEWLINE = $(NL)
lock: $(STAMP) ## recompile the universal hashed locks (runtime, dev, extras) from the .in files (network), record sidecars
	$(UV_COMPILE) -o requirements.lock requirements.in
	$(UV_COMPILE) -o requirements-dev.lock requirements-dev.in
	$(foreach e,$(KNOWN_EXTRAS),$(UV_COMPILE) -o requirements-$(e).lock requirements-$(e).in$(NL))
	$(RECORD_LOCKS)

upgrade: $(STAMP) ## upgrade one package in the locks: make upgrade PKG=numpy
	@test -n $(call q,PKG) || { echo "error: name the package: make upgrade PKG=<name>"; exit 2; }
	$(UV_COMPILE) --upgrade-package $(call q,PKG) -o requirements.lock requirements.in
	$(UV_COMPILE) --upgrade-package $(call q,PKG) -o requirements-dev.lock requirements-dev.in
	$(foreach e,$(KNOWN_EXTRAS),$(UV_COMPILE) --upgrade-package $(call q,PKG) -o requirements-$(e).lock requirements-$(e).in$(NL))
	$(RECORD_LOCKS)

check-lock: ## validate the locks offline: pinned, hashed, no local paths, fresh, every platform complete
	@PYTHONPATH=src $(PY_ANY) -m reprotrain.tools.locks.check_lock

env-check: ## compare the installed .venv with the locks (+ the extras installed; markers for this host); non-zero on drift
	@test -x $(PY) || { echo "error: no $(VENV); run make install"; exit 1; }
	@PYTHONPATH=src $(PY) -m reprotrain.tools.locks.env_check

pin-base: ## resolve BASE_IMAGE to a digest into docker/base-image.env (needs a registry)
	@$(PY_ANY) scripts/pin_base.py

docker-base: ## a base image from the Debian archive alone (mmdebstrap), for hosts with no registry [BASE_NAME=localhost/reprotrain-base:bookworm DEBIAN_MIRROR=...]
	$(check_engine)
	$(check_docker_names)
	@command -v mmdebstrap >/dev/null || { echo "error: make docker-base needs mmdebstrap (Debian: apt-get install mmdebstrap)" >&2; exit 2; }
	sh scripts/build_base.sh $(E) $(call q,BASE_NAME) $(call q,DEBIAN_MIRROR)

docker-build: check-lock ## build the image reprotrain:<commit>-<lock sha256[:12]> [ENGINE=docker|podman] [BASE_REF=<image>]
	$(check_engine)
	$(check_docker_names)
	@$(if $(value BASE_REF),echo "base: "$(call q,BASE_REF),$(if $(BASE_DIGEST),echo "base: $(PINNED_BASE)",echo "warning: base image $(BASE_IMAGE) is not pinned by digest; run make pin-base"))
	$(call build_image,runtime,$(IMAGE_NAME))
	@echo "built "$(IMAGE_NAME)

docker-train: ## train in the image (one GPU when the nvidia runtime is there; GPUS=all|none|cdi, SHM=2g): make docker-train ARGS=...
	$(check_engine)
	$(check_docker_names)
	@$(E) image inspect $(IMAGE_NAME) >/dev/null 2>&1 || $(MAKE) --no-print-directory docker-build
	mkdir -p data outputs
	$(WITH_ARGS) $(E) run --rm $(DOCKER_GPUS) --shm-size $(call q,SHM) --user $$(id -u):$$(id -g) -e HOME=/tmp \
		$(call run_identity,$(IMAGE_NAME)) -v "$$(pwd)/data:/app/data" -v "$$(pwd)/outputs:/app/outputs" $(IMAGE_NAME)

docker-test: check-lock ## run the test suite inside the image (test stage, dev lock) [ARGS="<pytest arguments>"]
	$(check_engine)
	$(check_docker_names)
	$(call build_image,test,$(IMAGE_NAME)-test)
	$(WITH_ARGS) $(E) run --rm $(call run_identity,$(IMAGE_NAME)-test) $(IMAGE_NAME)-test
