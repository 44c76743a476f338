#!/usr/bin/env bash
# The GPU checks, as one script for a lent CUDA machine (see the device tool):
# the suite with the Triton kernels on CUDA, the interpreter twins, and the
# benchmark's target point (CUDA-event times, sync-debug check, NVTX ranges).
# Writes logs and the benchmark JSON/PNG under $OUT (default: gpu_check_out/).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
python="${PYTHON:-python3}"

{ nvidia-smi; "$python" -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
  >"$out/machine.txt" 2>&1
# What the image lacks travels as wheels in .whl/ (scripts/gpu_wheels.sh; carry .whl).
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$out/install.txt" 2>&1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . >>"$out/install.txt" 2>&1
"$python" -c "import gpu_planner, numba, nvtx; print('numba', numba.__version__)" \
  >>"$out/machine.txt" 2>&1 || { echo "gpu_planner does not import" | tee -a "$out/summary.txt"; }

# Core kernels on CUDA (TRITON_INTERPRET unset), then their interpreter twins.
env -u TRITON_INTERPRET timeout 240 "$python" -m pytest -q -x tests --ignore=tests/integration \
  --ignore=tests/bench -p no:cacheprovider >"$out/pytest_cuda.txt" 2>&1
echo "pytest cuda rc=$?" | tee -a "$out/summary.txt"
TRITON_INTERPRET=1 timeout 200 "$python" -m pytest -q -x tests/test_plan.py tests/test_runs.py \
  -k "not million" -p no:cacheprovider >"$out/pytest_interpreter.txt" 2>&1
echo "pytest interpreter rc=$?" | tee -a "$out/summary.txt"
if "$python" -c "import sglang.srt.disaggregation.mooncake.conn" >/dev/null 2>&1; then
  env -u TRITON_INTERPRET timeout 120 "$python" -m pytest -q \
    tests/integration/sglang/test_plugin_loading.py -k cuda -p no:cacheprovider \
    >"$out/pytest_sglang_cuda.txt" 2>&1
  echo "pytest sglang cuda rc=$?" | tee -a "$out/summary.txt"
fi
env -u TRITON_INTERPRET timeout 150 "$python" -m bench.run --target --reference loop \
  --out "$out" >"$out/bench_target.txt" 2>&1
echo "bench rc=$?" | tee -a "$out/summary.txt"
tail -n 40 "$out/bench_target.txt"
