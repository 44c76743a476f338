"""NVTX ranges work without the `nvtx` package: torch.cuda.nvtx, else no-ops, logged once."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Run first in a fresh interpreter: makes `import <name>` fail for each blocked module.
BLOCK_IMPORTS = """
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} hidden by the test")
sys.meta_path.insert(0, Blocker())
"""

PLAN_WITH_RANGES = """
import logging
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import numpy as np
import gpu_planner as gp
from gpu_planner.profiling import nvtx_range
plan = gp.plan_transfer(np.arange(4), np.arange(4), gp.BufferLayout([0], [1 << 20], [64]))
assert plan.num_descriptors == 1
print("range:", type(nvtx_range("probe")).__name__)
print("nvtx imported:", "nvtx" in sys.modules)
"""


def run_hidden(blocked: set[str], body: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter in which importing any of `blocked` fails."""
    script = f"BLOCKED = {blocked!r}\n" + BLOCK_IMPORTS + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )


def test_without_nvtx_package_ranges_come_from_torch():
    result = run_hidden({"nvtx"}, PLAN_WITH_RANGES)
    assert "range: _TorchRange" in result.stdout
    assert "nvtx imported: False" in result.stdout
    logged = [line for line in result.stderr.splitlines() if "nvtx package is absent" in line]
    assert logged == [
        "gpu_planner.profiling gpu_planner: the nvtx package is absent; "
        "NVTX ranges from torch.cuda.nvtx"
    ]


TORCH_WITHOUT_NVTX = """
import torch.cuda.nvtx
def not_built(*args):
    raise RuntimeError("NVTX functions not installed")  # torch's stub where NVTX is absent
torch.cuda.nvtx.range_push = not_built
"""


def test_without_any_nvtx_ranges_are_no_ops():
    result = run_hidden({"nvtx"}, TORCH_WITHOUT_NVTX + PLAN_WITH_RANGES)
    assert "range: nullcontext" in result.stdout
    assert result.stderr.count("nvtx package is absent") == 1


def test_with_nvtx_package_ranges_are_nvtx_annotations():
    from gpu_planner.profiling import nvtx_range

    assert type(nvtx_range("probe")).__module__.startswith("nvtx")


def test_sglang_plugin_hooks_without_nvtx():
    """A full sglang install has no `nvtx` package: the plugin still loads and hooks its targets."""
    pytest.importorskip("sglang", reason="no sglang (scripts/setup.sh test installs it)")
    result = run_hidden(
        {"nvtx"},
        """
        import warnings
        warnings.simplefilter("ignore")
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from gpu_planner.integration.sglang.plugin import PAGES_TARGET, SEND_TARGET
        load_plugins()
        print("hooked:", sorted(t for t in (SEND_TARGET, PAGES_TARGET) if HookRegistry._hooks[t]))
        print("nvtx imported:", "nvtx" in sys.modules)
        """,
    )
    assert "hooked: ['sglang.srt.disaggregation" in result.stdout
    assert "kv_to_page_indices'" in result.stdout
    assert "nvtx imported: False" in result.stdout
