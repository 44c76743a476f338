#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), the wheels that scripts/gpu_check.sh needs and
# the device machine's image lacks (it has torch, triton, numba, pytest,
# hypothesis, matplotlib; Python 3.12; no network). Carry .whl with the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
platforms=()
for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$platform")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "nvtx==0.2.17" \
  2> >(grep -v "^WARNING: Location 'file:" >&2)
# NumPy 2.3 for the interpreter check alone (gpu_check.sh says why).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl/interpreter "numpy==2.3.5" \
  2> >(grep -v "^WARNING: Location 'file:" >&2)
ls .whl .whl/interpreter
