#!/usr/bin/env bash
# One-shot GPU check: bash scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--budget SECONDS]
#
# For any machine with one CUDA GPU and no network. Prints ONE JSON on stdout (progress on
# stderr), in the order that finds bugs first: pytest -m gpu; the reference job (ResNet-18,
# strict at its setting: tf32, channels_last; 50k synthetic images, 2 epochs) twice and a
# resume after SIGKILL, compared bit for bit; twins at each trainer.precision (final
# loss/accuracy, images/s, the projected 30-epoch recipe); bench.py --device cuda (P1/P3 on
# the bench net and the reference model, the strict-cost table); the world-size-invariant /
# plain DDP step-time ratio (bench.py --only invariant, NCCL). A section left without time
# is recorded as skipped. See scripts/benchmarks/gpu_check.py. Budget: 540 s on one H200.
#
# Missing hydra-core / omegaconf / antlr4 are installed offline from a wheels folder
# (--wheels DIR, else $WHEELS, else shared/wheels or wheels/ in the repo) into a private
# folder; nothing else on the machine changes. Make that folder where pip has a network:
#   python -m pip wheel --no-deps -w shared/wheels \
#       hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
# (pure-Python wheels; versions as in requirements.lock). Without a CUDA GPU it stops at
# once with one line on stderr and exit 2.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
WHEELS=${WHEELS:-}
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=${2:-}; shift 2 ;;
    --wheels=*) WHEELS=${1#--wheels=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done

fail() { echo "error: gpu_check: $*" >&2; exit 2; }

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3 || command -v python) || fail "no python3 on PATH"
fi

# First, and in one line: is there a GPU at all? (stderr of the probe is dropped: a
# driver-less torch may warn on several lines.)
probe=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()), torch.__version__)' 2>/dev/null) \
  || fail "$PY cannot import torch; install the project (make install) or set PYTHON=..."
[ "${probe%% *}" = "1" ] \
  || fail "no CUDA GPU visible to torch ${probe#* } on $(hostname); run this on a machine with one CUDA GPU"

SITE=${TMPDIR:-/tmp}/reprotrain-gpu-check-site
export PYTHONPATH="$REPO/src:$REPO/scripts:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import hydra, omegaconf' 2>/dev/null; then
  if [ -z "$WHEELS" ]; then
    for d in "$REPO/shared/wheels" "$REPO/wheels"; do [ -d "$d" ] && WHEELS=$d && break; done
  fi
  [ -n "$WHEELS" ] && [ -d "$WHEELS" ] \
    || fail "hydra-core/omegaconf missing and no wheels folder (give --wheels DIR, see the header of scripts/gpu_check.sh)"
  echo "gpu_check: installing hydra-core, omegaconf, antlr4 from $WHEELS into $SITE" >&2
  "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-cache-dir \
      --find-links "$WHEELS" --target "$SITE" \
      hydra-core omegaconf antlr4-python3-runtime >&2 \
    || fail "offline install from $WHEELS failed (need hydra-core, omegaconf, antlr4-python3-runtime)"
  "$PY" -c 'import hydra, omegaconf' 2>/dev/null || fail "hydra/omegaconf still not importable after install"
fi

export PYTHONHASHSEED=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "${ARGS[@]}"
