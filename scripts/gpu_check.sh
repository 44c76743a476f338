#!/usr/bin/env bash
# The GPU checks of one CUDA machine, in two runs of under 8 minutes each (docs/testing.md):
#   scripts/gpu_check.sh core    warm-up and its zero compiles, the call budgets, the suite's
#                                kernels on CUDA, tests/cuda, the head-slice gather, and the
#                                benchmark's target point (carry .whl/core)
#   scripts/gpu_check.sh sglang  sglang's page hook, its CUDA tests and a staged send between
#                                two processes through real Mooncake (carry .whl/sglang)
# What the image lacks travels as wheels in .whl/RUN/ (scripts/gpu_wheels.sh).
# Stops only on a broken install; every check after that runs even when an earlier one
# failed, and prints one "PASS|FAIL name seconds figure" line. Logs, the summary and the
# benchmark JSON/PNG go under $OUT (default: gpu_check_out/).
# Exit status: the number of failed checks (0: all passed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
run="${1:-}"
case "$run" in
  core | sglang) ;;
  *) echo "usage: $0 core|sglang" >&2; exit 2 ;;
esac
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
failures=0

report() {  # status name seconds figure
  printf '%s %-34s %4ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$out/summary.txt"
}

figure() {  # log: its last "figure: " line, else pytest's summary line, else its last line
  local line
  line="$(sed -n 's/^figure: //p' "$1" | tail -n 1)"
  [ -n "$line" ] || line="$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$1" \
    | tail -n 1 | tr -d '=' | sed 's/^ *//')"
  [ -n "$line" ] || line="$(tail -n 1 "$1")"
  echo "$line"
}

check() {  # name timeout_s command...: one PASS/FAIL line, log in $out/name.log
  local name=$1 limit=$2 start=$SECONDS status=PASS
  shift 2
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || status=FAIL
  [ "$status" = PASS ] || failures=$((failures + 1))
  report "$status" "$name" $((SECONDS - start)) "$(figure "$out/$name.log")"
}

broken_install() {
  echo "FAIL install: $1 (log: $out/install.txt)" | tee -a "$out/summary.txt"
  tail -n 20 "$out/install.txt"
  exit 100
}

# The system libraries Mooncake's engine.so loads and the image lacks: libcudart from
# torch's CUDA runtime wheel, RDMA verbs and NUMA from the carried Debian packages, and
# libcurl (its HTTP metadata client, never called over TCP with P2P handshake) as a
# stub whose every function fails, like scripts/mooncake_loader.sh's driver stub.
mooncake_libraries() {
  local engine=/tmp/site/mooncake/engine.so libs=/tmp/mooncake-libs
  mkdir -p "$libs"
  local cudart
  cudart="$(find "$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')/nvidia" \
    -name 'libcudart.so.1[0-9]*' 2>/dev/null | head -n 1)"
  [ -n "$cudart" ] && export LD_LIBRARY_PATH="$(dirname "$cudart")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ldd "$engine" | grep -q -E 'lib(ibverbs|mlx5|numa)[^ ]* => not found'; then
    for deb in .whl/sglang/debs/*.deb; do dpkg -x "$deb" "$libs/root"; done
    export LD_LIBRARY_PATH="$libs/root/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
  fi
  if ldd "$engine" | grep -q 'libcurl.so.4 => not found'; then
    nm -D --undefined-only "$engine" | awk '$2 ~ /^curl_/ { print "int " $2 "(void) { return 2; }" }' \
      >"$libs/curl_stub.c"
    cc -shared -fPIC -Wl,-soname,libcurl.so.4 -o "$libs/libcurl.so.4" "$libs/curl_stub.c"
    export LD_LIBRARY_PATH="$libs:$LD_LIBRARY_PATH"
  fi
  ldd "$engine" | grep 'not found'
  return 0
}

{ nvidia-smi; "$python" -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
  >"$out/machine.txt" 2>&1
if compgen -G ".whl/$run/*.whl" >/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ".whl/$run"/*.whl >"$out/install.txt" 2>&1 || broken_install "carried wheels"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -m pip install -q --no-deps --no-build-isolation -e . >>"$out/install.txt" 2>&1 \
  || broken_install "editable install of gpu_planner"
"$python" -c "import gpu_planner, gpu_planner.kernels.run_scan, gpu_planner.kernels.expand_descriptors, \
gpu_planner.kernels.page_indices, numba, torch; assert torch.cuda.is_available(); \
print('numba', numba.__version__)" >>"$out/install.txt" 2>&1 \
  || broken_install "gpu_planner, its kernels or CUDA do not import"
if [ "$run" = sglang ]; then
  mooncake_libraries >>"$out/install.txt" 2>&1
  "$python" -c "import mooncake.engine, sglang.srt.disaggregation.mooncake.conn, \
sglang.srt.disaggregation.decode, sglang.srt.disaggregation.prefill, sglang.srt.mem_cache.common" \
    >>"$out/install.txt" 2>&1 || broken_install "Mooncake or sglang's modules do not import"
fi

cuda=(env -u TRITON_INTERPRET)
pytest=("$python" -m pytest -q -p no:cacheprovider)

# 1. Compile every variant first and time it: what the sglang plugin does at start-up.
check warmup 45 "${cuda[@]}" "$python" -c "import time, gpu_planner as gp
start = time.perf_counter(); launches = gp.warmup()
print(f'figure: {launches} launches in {time.perf_counter() - start:.1f} s')"

if [ "$run" = core ]; then
  # 1. Warm-up compiles every kernel a request launches: the sweep compiles nothing more.
  check aot_compile 40 "${cuda[@]}" "$python" - <<'EOF'
import json, os, subprocess, sys
result = subprocess.run([sys.executable, "tests/kernels/aot_compile.py"], capture_output=True,
                        text=True, check=True, env={**os.environ, "TRITON_INTERPRET": "0"})
report = json.loads(result.stdout.strip().splitlines()[-1])
print(json.dumps(report, indent=1))
new, control = report["new_after_warmup"], report["control_new_compiles"]
print(f"figure: {report['compiled_variants']} variants, {report['swept_launches']} swept launches, "
      f"{len(new)} new after warm-up, control {control}")
sys.exit(0 if not new and control > 0 else 1)
EOF
  # 5. The Triton plan's call budgets (launches, allocations, device lookups, JIT runs).
  check call_budgets 40 "${cuda[@]}" "${pytest[@]}" tests/test_plan_budget.py \
    tests/kernels/test_launch_budget_sm90.py
  # The core suite with the kernels on CUDA (tests/cuda reported per test below).
  # (tests/e2e starts sglang servers on CPU: CI runs them; the image has no sglang.)
  check pytest_cuda 120 "${cuda[@]}" "${pytest[@]}" tests --ignore=tests/integration \
    --ignore=tests/bench --ignore=tests/cuda --ignore=tests/e2e --ignore=tests/kernels \
    --ignore=tests/test_plan_budget.py
  # Staging lifetimes on the device: results of one copy checked after the next ones.
  check lifetimes 30 "${cuda[@]}" "${pytest[@]}" tests/test_cuda_host_path.py -k "cuda and not stand"
  # Streams, threads, devices (the KV's device from its memory, every device when 2+),
  # sync-debug, graph replay, 2**20 pages: one line per test.
  start=$SECONDS
  "${cuda[@]}" timeout 60 "${pytest[@]}" tests/cuda -rA --junitxml="$out/cuda_paths.xml" \
    >"$out/cuda_paths.log" 2>&1
  "$python" - "$out/cuda_paths.xml" $((SECONDS - start)) >"$out/cuda_paths.lines" <<'EOF'
import sys, xml.etree.ElementTree as ElementTree
try:
    cases = ElementTree.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ElementTree.ParseError):
    print(f"FAIL cuda_paths {sys.argv[2]} no report"); sys.exit()
for case in cases:
    failed = case.find("failure") is not None or case.find("error") is not None
    status = "SKIP" if case.find("skipped") is not None else "FAIL" if failed else "PASS"
    print(status, "cuda::" + case.get("name"), f"{float(case.get('time', 0)):.0f}", "one test")
EOF
  while read -r status name seconds what; do
    report "$status" "$name" "$seconds" "$what"
    [ "$status" = FAIL ] && failures=$((failures + 1))
  done <"$out/cuda_paths.lines"
  # The head-slice gather on CUDA, and its bandwidth against a device copy (exit 1 below 0.7).
  check head_gather_cuda 20 "${cuda[@]}" "${pytest[@]}" tests/test_head_gather.py
  check head_gather_bandwidth 20 "${cuda[@]}" "$python" -m bench.head_gather
  # 5. The target point (page 64, 128k tokens, 61 buffers): CUDA-event times, the sync-debug
  # check, NVTX ranges; PASS where the Triton plan's wall time is under 150 us and no
  # slower than the CPU backend's on this host.
  check bench_target 80 "${cuda[@]}" "$python" -m bench.run --target --reference loop \
    --out "$out" --name target
  check plan_wall_time 5 "$python" - "$out/target.json" <<'EOF'
import json, sys
targets = json.load(open(sys.argv[1]))["targets"]
wall = [t for t in targets if t["name"].startswith("page 64: Triton wall time")]
for t in targets:
    print(("PASS " if t["passed"] else "FAIL ") + t["name"] + ": " + t["measured"])
print("figure: " + "; ".join(t["measured"] for t in wall))
sys.exit(0 if len(wall) == 2 and all(t["passed"] for t in wall) else 1)
EOF
else
  # 2. The page hook on CUDA rows: HiSparse's two spaces in one launch, byte-identical to
  # sglang's two lists, and the hook's measured choice against sglang's .cpu() path.
  check pages_hook 60 "${cuda[@]}" "${pytest[@]}" -rA tests/integration/sglang/test_pages_hook.py \
    tests/integration/sglang/test_decode_pages.py
  # 3. The plugin's CUDA tests (gathers, staging, page conversion) with sglang.
  check sglang_cuda 120 "${cuda[@]}" "${pytest[@]}" tests/integration/sglang -k cuda \
    --ignore=tests/integration/sglang/test_pages_hook.py \
    --ignore=tests/integration/sglang/test_decode_pages.py \
    --ignore=tests/integration/sglang/test_staged_send_processes.py
  # 4. A staged send between two processes on this GPU through real Mooncake (TCP): device
  # slots and the gather, a device region and the scatter, sglang's bytes, no compile
  # after warm-up in either process.
  check staged_send_processes 120 "${cuda[@]}" "${pytest[@]}" -rA \
    tests/integration/sglang/test_staged_send_processes.py -k cuda
fi
echo "failed checks: $failures" | tee -a "$out/summary.txt"
exit "$failures"
