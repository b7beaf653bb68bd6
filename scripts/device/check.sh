#!/usr/bin/env bash
# The device bundle: one command that turns a short loan of a GPU (or TPU) host into the whole
# speed table. Installs the carried wheels (.whl/, from prepare_wheels.sh) into a temporary
# folder, uses the checkout in place (no pip install), then runs check.py's priority-ordered
# plan under a time budget. Results go to $OUT (the device tool's folder) or runs/device/<time>.
#   bash scripts/device/check.sh [--budget_s=450] [--plan=gpu|tiny] [--only=a,b]
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
OUTDIR=${OUT:-$ROOT/runs/device/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUTDIR"
# Only where the interpreter lacks them (a CPU venv made from setup.py has them all).
if ! "$PY" -c "import grain, ml_collections, tensorboardX" 2>/dev/null \
    && compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  SITE=${DEVICE_SITE:-/tmp/diloco_device_site}
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$ROOT"/.whl/*.whl || { echo "check.sh: installing .whl/ failed"; exit 3; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -c "import flax.nnx" 2>/dev/null; then
  export PYTHONPATH=$ROOT/scripts/device/shim:$PYTHONPATH
  echo "check.sh: flax needs the import shim (scripts/device/shim) under this JAX"
fi
export PYTHONUNBUFFERED=1
exec "$PY" "$ROOT/scripts/device/check.py" --out="$OUTDIR" "$@"
