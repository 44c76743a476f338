"""Run in a process whose sglang is another release (PYTHONPATH): what the plugin does there.

Prints one JSON object: the sglang version imported, the targets `register()` hooked,
the plugin's WARNING lines, and `gpu-planner info`'s plugin row.
"""

from __future__ import annotations

import json
import logging
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sglang's GPU-only quantization kernels, on a CPU
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry

from gpu_planner.integration import info
from gpu_planner.integration.sglang import plugin


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


warning_lines = Lines()
logging.getLogger("gpu_planner").addHandler(warning_lines)
plugin.register()
print(
    json.dumps(
        {
            "version": sglang.__version__,
            "file": sglang.__file__,
            "hooked": sorted(HookRegistry._hooks),
            "warnings": warning_lines.lines,
            "info": dict(info.sglang_plugin())["plugin"],
        }
    )
)
