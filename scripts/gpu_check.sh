#!/usr/bin/env bash
# The GPU checks, as one script for a CUDA machine (one H200: under 8 minutes).
# Stops only on a broken install; every check after that runs even when an
# earlier one failed, and prints one "PASS|FAIL name seconds" line. Logs, the
# summary and the benchmark JSON/PNG go under $OUT (default: gpu_check_out/).
# Exit status: the number of failed checks (0: all passed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
failures=0

report() {  # status name seconds
  printf '%s %-44s %5ss\n' "$1" "$2" "$3" | tee -a "$out/summary.txt"
}

check() {  # name timeout_s command...: one PASS/FAIL line, log in $out/name.log
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    report PASS "$name" $((SECONDS - start))
  else
    report FAIL "$name" $((SECONDS - start))
    failures=$((failures + 1))
  fi
}

broken_install() {
  echo "FAIL install: $1 (log: $out/install.txt)" | tee -a "$out/summary.txt"
  tail -n 20 "$out/install.txt"
  exit 100
}

{ nvidia-smi; "$python" -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
  >"$out/machine.txt" 2>&1
# What the image lacks travels as wheels in .whl/ (scripts/gpu_wheels.sh; carry .whl).
if compgen -G ".whl/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >"$out/install.txt" 2>&1 || broken_install "carried wheels"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . >>"$out/install.txt" 2>&1 \
  || broken_install "editable install of gpu_planner"
"$python" -c "import gpu_planner, gpu_planner.kernels.run_scan, gpu_planner.kernels.expand_descriptors, \
gpu_planner.kernels.page_indices, numba, torch; assert torch.cuda.is_available(); \
print('numba', numba.__version__)" >>"$out/install.txt" 2>&1 \
  || broken_install "gpu_planner, its kernels or CUDA do not import"

cuda=(env -u TRITON_INTERPRET)
interpreter=(env TRITON_INTERPRET=1)
pytest=("$python" -m pytest -q -p no:cacheprovider)

# Compile every variant first and time it: what the sglang plugin does at start-up.
check warmup 240 "${cuda[@]}" "$python" -c "import time, gpu_planner as gp
start = time.perf_counter(); launches = gp.warmup()
print(f'{launches} launches, {time.perf_counter() - start:.1f} s')"
# The core suite with the kernels on CUDA (tests/cuda reported per test below).
# (tests/e2e starts sglang servers on CPU: CI runs them; the image has no sglang.)
check pytest_cuda 200 "${cuda[@]}" "${pytest[@]}" tests --ignore=tests/integration \
  --ignore=tests/bench --ignore=tests/cuda --ignore=tests/e2e
# Staging lifetimes on the device: results of one copy checked after the next ones.
check lifetimes 120 "${cuda[@]}" "${pytest[@]}" tests/test_cuda_host_path.py -k "cuda and not stand"
# Streams, threads, devices (the KV's device from its memory, every device when 2+), sync-debug,
# graph replay, 2**20 pages: one line per test.
start=$SECONDS
"${cuda[@]}" timeout 240 "${pytest[@]}" tests/cuda -rA --junitxml="$out/cuda_paths.xml" \
  >"$out/cuda_paths.log" 2>&1
"$python" - "$out/cuda_paths.xml" $((SECONDS - start)) >"$out/cuda_paths.lines" <<'EOF'
import sys, xml.etree.ElementTree as ElementTree
try:
    cases = ElementTree.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ElementTree.ParseError):
    print(f"FAIL cuda_paths {sys.argv[2]}"); sys.exit()
for case in cases:
    failed = case.find("failure") is not None or case.find("error") is not None
    status = "SKIP" if case.find("skipped") is not None else "FAIL" if failed else "PASS"
    print(status, "cuda::" + case.get("name"), f"{float(case.get('time', 0)):.0f}")
EOF
while read -r status name seconds; do
  report "$status" "$name" "$seconds"
  [ "$status" = FAIL ] && failures=$((failures + 1))
done <"$out/cuda_paths.lines"
# The interpreter twins of the kernel tests, on the same machine. Triton 3.6's
# interpreter takes int() of 1-element arrays, which NumPy 2.4 refuses (Triton 3.8
# squeezes first): where .whl/interpreter/ holds a NumPy 2.3 wheel, this check uses it.
interpreter_path=${PYTHONPATH:-}
if compgen -G ".whl/interpreter/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-interpreter .whl/interpreter/*.whl >>"$out/install.txt" 2>&1 \
    || broken_install "carried interpreter wheels"
  interpreter_path="/tmp/site-interpreter${interpreter_path:+:$interpreter_path}"
fi
check pytest_interpreter 200 "${interpreter[@]}" PYTHONPATH="$interpreter_path" "${pytest[@]}" \
  tests/test_plan.py tests/test_runs.py tests/test_pending.py tests/test_cuda_host_path.py tests/cuda
if "$python" -c "import sglang.srt.disaggregation.mooncake.conn" >/dev/null 2>&1; then
  check pytest_sglang_cuda 120 "${cuda[@]}" "${pytest[@]}" tests/integration/sglang -k cuda
  check lifetimes_sglang_pages 120 "${cuda[@]}" "${pytest[@]}" \
    tests/integration/sglang/test_pages_hook.py
fi
# The head-slice gather on CUDA, and its bandwidth against a device copy (exit 1 below 0.7).
check head_gather_cuda 120 "${cuda[@]}" "${pytest[@]}" tests/test_head_gather.py
check head_gather_bandwidth 120 "${cuda[@]}" "$python" -m bench.head_gather
tail -n 1 "$out/head_gather_bandwidth.log"
# The benchmark's target point: CUDA-event times, the sync-debug check, NVTX ranges.
check bench_target 150 "${cuda[@]}" "$python" -m bench.run --target --reference loop \
  --out "$out"
tail -n 40 "$out/bench_target.log"
echo "failed checks: $failures" | tee -a "$out/summary.txt"
exit "$failures"
