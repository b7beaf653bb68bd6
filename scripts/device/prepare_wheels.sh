#!/usr/bin/env bash
# Downloads, into the checkout's ignored .whl/ folder, the Python 3.12 wheels a GPU host with its
# own JAX stack lacks (no network there): check.sh installs them with --no-deps into a temporary
# folder. Run on a machine that reaches PyPI; needs only pip. Usage: scripts/device/prepare_wheels.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
# Pure-Python wheels and the two compiled ones (grain, array_record), pinned to the versions the
# CPU CI runs; flax 0.12.8 replaces an image's flax that does not import under its JAX.
PACKAGES=(grain==0.2.18 array_record==0.8.6 ml_collections==1.1.0 tensorboardX==2.6.5
          portpicker==1.6.0 flax==0.12.8)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p "$ROOT/.whl"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
  --implementation cp "${PLATFORMS[@]}" -d "$ROOT/.whl" "${PACKAGES[@]}"
ls -1 "$ROOT/.whl"
