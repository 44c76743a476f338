#!/usr/bin/env bash
# Set up .venv for the tests, then lint and run the whole suite (no GPU needed:
# without CUDA the Triton kernels run under the Triton interpreter). The suite
# includes tests/e2e, which starts real sglang servers (about 14 min of the
# suite's 24 on 2 cores, at most ~10 GiB at once); `-m "not e2e"` leaves it out.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
