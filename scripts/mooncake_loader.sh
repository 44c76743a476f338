#!/usr/bin/env bash
# Make a CUDA build of Mooncake's engine.so load in .venv: `import mooncake.engine`
# with no extra environment variables, on a GPU machine or a CPU-only one.
#
# engine.so (mooncake-transfer-engine-cuda12/13) needs libcudart and libcuda.so.1,
# the driver, and its RPATH starts with $ORIGIN (its own folder). So:
# - libcudart: when the system loader does not find it, link torch's copy (the
#   nvidia-cuda-runtime wheel) into that folder, which also keeps one CUDA
#   runtime per process;
# - libcuda.so.1: without a real driver (CPU machine), build a stub with the system
#   C compiler whose every cu* function engine.so imports returns
#   CUDA_ERROR_NO_DEVICE (100); the TCP transport never calls them. With a real
#   driver any stub left from an earlier run is removed.
# Usage: scripts/mooncake_loader.sh PYTHON. Idempotent; no-op for the non-CUDA build.
set -euo pipefail
python="$1"
pkg="$("$python" -c 'import importlib.util as u; s = u.find_spec("mooncake"); print(s.submodule_search_locations[0] if s else "")')"
[ -n "$pkg" ] && [ -f "$pkg/engine.so" ] || exit 0

# The sonames engine.so needs, e.g. libcudart.so.13 (none for the non-CUDA build).
needed() { readelf -d "$pkg/engine.so" | sed -n "s/.*(NEEDED).*\[\($1\)\]/\1/p"; }
cudart="$(needed 'libcudart\.so\.[0-9]*')"
driver="$(needed 'libcuda\.so\.1')"
in_system() { ldconfig -p | grep -q "^[[:space:]]*$1 "; }

if [ -n "$cudart" ] && ! in_system "$cudart" && [ ! -e "$pkg/$cudart" ]; then
  site="$(dirname "$pkg")"
  found="$(find "$site/nvidia/" -name "$cudart" 2>/dev/null | head -1)"
  if [ -z "$found" ]; then
    echo "mooncake_loader: $cudart not found (install nvidia-cuda-runtime for it)" >&2
    exit 1
  fi
  ln -s "$(realpath --relative-to="$pkg" "$found")" "$pkg/$cudart"
fi

if [ -n "$driver" ]; then
  stub="$pkg/$driver"
  if in_system "$driver"; then
    rm -f "$stub"  # a real driver: never shadow it
  elif [ ! -e "$stub" ]; then
    src="$(mktemp --suffix=.c)"
    trap 'rm -f "$src"' EXIT
    echo "/* libcuda.so.1 stub for CPU machines: every call reports no device. */" >"$src"
    nm -D --undefined-only "$pkg/engine.so" | awk '$2 ~ /^cu[A-Z]/ { print $2 }' | sort -u \
      | while read -r symbol; do echo "int $symbol(void) { return 100; }"; done >>"$src"
    cc -shared -fPIC -O2 -Wl,-soname,"$driver" -o "$stub" "$src"
  fi
fi

"$python" -c "import mooncake.engine"
