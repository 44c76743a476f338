#!/usr/bin/env bash
# Fetch, into .whl/ (git-ignored), what scripts/gpu_check.sh needs and the device
# machine's image lacks (it has torch, triton, numba, pytest, hypothesis and
# matplotlib; Python 3.12; no network), one folder per run, each carried alone:
#   .whl/core/    nvtx (the benchmark's NVTX ranges)
#   .whl/sglang/  sglang 0.5.23 and Mooncake 0.3.14 (CUDA 13), trimmed
#                 (scripts/trim_wheel.py), the packages sglang's imported modules need
#                 that the image lacks, and in debs/ the system libraries Mooncake's
#                 engine.so loads (RDMA verbs, NUMA) as Debian packages.
# Prints each folder's size with the tracked tree's; fails where one run would pass 64 MiB.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python="${PYTHON:-.venv/bin/python}"
platforms=()
for n in 17 24 26 27 28 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # folder requirement...
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

rm -rf .whl/core .whl/sglang
download .whl/core "nvtx==0.2.17"

# The modules the sglang tests import (sglang's connector, decode, prefill, mem_cache and
# what they import) need these, at the versions .venv's tests run with.
download .whl/sglang annotated-types==0.8.0 apache-tvm-ffi==0.1.11 cffi==2.1.1 \
  compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 gguf==0.19.0 ipython==9.19.1 \
  loguru==0.7.3 msgspec==0.23.0 openai==2.8.0 opentelemetry-api==1.45.3 orjson==3.13.0 \
  partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4 \
  pydantic-core==2.50.5 python-multipart==0.0.34 pyzmq==27.3.0 sniffio==1.3.1 \
  soundfile==0.13.1 starlette==1.10.0 traitlets==5.16.1 typing-inspection==0.4.5 \
  xgrammar==0.2.7 zstandard==0.25.0
full="$(mktemp -d)"
trap 'rm -rf "$full"' EXIT
download "$full" sglang==0.5.23 mooncake-transfer-engine-cuda13==0.3.14
# sglang without its Rust extensions (server, gRPC, bench) and multimodal generation;
# Mooncake's transfer engine without its store, EP and process-group libraries.
"$python" scripts/trim_wheel.py "$full"/sglang-*.whl .whl/sglang \
  --drop 'sglang/srt/rust_extensions/*.so' --drop 'sglang/multimodal_gen/*'
"$python" scripts/trim_wheel.py "$full"/mooncake_transfer_engine_cuda13-*.whl .whl/sglang \
  --elf-closure mooncake/engine.so
mkdir -p .whl/sglang/debs
(cd .whl/sglang/debs && apt-get download -q libibverbs1 ibverbs-providers libnuma1 \
  libnl-3-200 libnl-route-3-200 2> >(grep -v "unsandboxed" >&2))

mib() { du -sb "$@" | awk '{ total += $1 } END { printf "%.1f", total / 1048576 }'; }
tree="$(git ls-files -z | xargs -0 du -cb | tail -1 | awk '{ printf "%.1f", $1 / 1048576 }')"
status=0
for run in core sglang; do
  size="$(mib ".whl/$run")"
  echo "run $run: .whl/$run ${size} MiB + tracked tree ${tree} MiB (limit 64)"
  awk -v a="$size" -v b="$tree" 'BEGIN { exit !(a + b >= 64) }' && status=1
done
exit "$status"
