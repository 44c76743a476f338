"""After the plugin's warm-up, a staged or gathered send on a GPU compiles no Triton kernel.

Runs `staged_send_compiles.py` in a subprocess with the interpreter off: real
Mooncake engines and managers, the KV on the CUDA stand-in's device, Triton's
real compile pipeline against the sm_90 stand-in driver, every compile counted.
"""

from pathlib import Path

import pytest
from aot_compile import script_report

pytest.importorskip("triton.backends.nvidia")
pytest.importorskip("sglang.srt.disaggregation.mooncake.conn")

GATHER = "gpu_planner.kernels.head_gather._gather_head_slices_kernel"
SCATTER = "gpu_planner.kernels.head_scatter._scatter_head_slices_kernel"
SUCCESS = 4  # sglang's KVPoll.Success


def test_a_staged_send_after_the_warmup_compiles_nothing():
    """Device slots gather and the device region scatters every piece (MHA, chunked, HiSparse),
    every request succeeds, and only the warm-up compiled: the gather and the scatter."""
    report = script_report(Path(__file__).with_name("staged_send_compiles.py"))
    assert report["warmed"] == [GATHER, SCATTER]
    assert report["launches"]["gather"] > 0 and report["launches"]["scatter"] > 0
    assert set(report["statuses"]) == {0, SUCCESS}
    assert report["new_after_warmup"] == []


def test_a_repaged_gathered_send_after_the_decodes_registration_compiles_nothing():
    """Prefill TP 1 -> decode TP 2 at page sizes 64 -> 16 and 16 -> 1: the gathers launch on
    unit pages (16, 1 tokens), which the manager's warm-up does not compile and the decode's
    registration does; every request succeeds and no send compiles."""
    report = script_report(Path(__file__).with_name("staged_send_compiles.py"), "repaged")
    assert report["gather_page_sizes"] == [[16], [1]]
    assert all(count > 0 for count in report["registration"]), report
    assert report["statuses"] == [[0, 0, SUCCESS]] * 2
    assert report["new_after_registration"] == [[], []]
