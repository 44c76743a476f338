#!/usr/bin/env bash
# Set up .venv at the repo root for the demo (`demo`) or the test suite (`test`).
# Installs the Debian packages Mooncake needs, pins a torch build that fits the
# machine, and installs gpu-planner in editable mode with the needed extras.
set -euo pipefail
mode="${1:-demo}"
case "$mode" in demo | test) ;; *) echo "usage: scripts/setup.sh demo|test" >&2; exit 2 ;; esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

need_debs=()
for deb in libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4; do
  dpkg -s "$deb" >/dev/null 2>&1 || need_debs+=("$deb")
done
# scripts/mooncake_loader.sh reads engine.so (readelf, nm) and may compile a stub driver.
command -v cc >/dev/null 2>&1 && command -v readelf >/dev/null 2>&1 || need_debs+=(gcc binutils)
if ((${#need_debs[@]})); then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need_debs[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
pip_install() {
  # This machine's pip config names local index folders that may not exist; drop
  # those warnings, keep everything else.
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" \
    2> >(grep -v "^WARNING: Location 'file:" >&2)
}

# torch: on a GPU machine keep/install a CUDA build; without a GPU pin the CPU
# build (2.13.0). The sglang plugin tests need torchvision, which only imports
# beside the torch 2.14.1 / torchvision 0.29.1 pair (checked: PyPI's torchvision does not import beside the CPU torch 2.13.0).
if [ "$mode" = test ]; then
  .venv/bin/python -c "import torchvision" 2>/dev/null \
    || pip_install "torch==2.14.1" "torchvision==0.29.1"
elif ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install torch
  else
    pip_install "torch==2.13.0"
  fi
fi

# Mooncake: the demo runs the non-CUDA build (list API), the tests the CUDA 13
# build 0.3.14 (arrays API). All flavours ship the same `mooncake` package, so
# first remove every flavour when one other than this mode's is installed.
mooncake_flavours=(mooncake-transfer-engine-non-cuda mooncake-transfer-engine mooncake-transfer-engine-cuda13)
case "$mode" in
  demo) mooncake_extra=mooncake-non-cuda mooncake_dist=mooncake-transfer-engine-non-cuda ;;
  test) mooncake_extra=mooncake-cuda13 mooncake_dist=mooncake-transfer-engine-cuda13 ;;
esac
for flavour in "${mooncake_flavours[@]}"; do
  if [ "$flavour" != "$mooncake_dist" ] && .venv/bin/python -m pip show -q "$flavour" >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -q -y "${mooncake_flavours[@]}" 2>/dev/null || true
    break
  fi
done

case "$mode" in
  demo) pip_install -e ".[$mooncake_extra,nvtx,bench]" ;;
  test)
    # sglang's pins first (numba==0.65.1 among them), so gpu-planner's looser
    # requirements are already met by the versions sglang users run.
    pip_install -r requirements/sglang-light.txt
    pip_install -e ".[test,$mooncake_extra,bench]" "$mooncake_dist==0.3.14"
    pip_install --no-deps "sglang==0.5.23"
    # Real sglang servers and the smg router (tests/e2e, bench.deployment).
    pip_install -r requirements/sglang-server.txt
    # Mooncake 0.3.13 (list API) beside 0.3.14, in its own folder: e2e servers that
    # put it first on PYTHONPATH import it instead (the list hand-off scenario).
    [ -f .venv/mooncake-0.3.13/mooncake/engine.so ] \
      || pip_install --no-deps --target .venv/mooncake-0.3.13 "mooncake-transfer-engine-non-cuda==0.3.13.post1"
    ;;
  *) echo "usage: scripts/setup.sh demo|test" >&2; exit 2 ;;
esac
bash scripts/mooncake_loader.sh .venv/bin/python
