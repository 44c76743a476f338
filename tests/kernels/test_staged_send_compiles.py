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
SCATTER_THREAD = "gpu_planner-scatter-compile"  # `ReceiveRegion.scatter_unready`'s
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


def test_a_staged_send_to_another_page_size_compiles_nothing_once_the_decodes_scatter_has():
    """Pages 16 -> 64 and 64 -> 16, staged in the decode's receive staging in pages of their
    gcd (16 tokens): the prefill's gathers of them compile at the decode's registration (for
    64 -> 16; 16 is 16 -> 64's own page), the decode's scatter of them (for 16 -> 64; 16 is
    64 -> 16's own page) on a thread of its own at the first request, which goes direct
    meanwhile. Every later request is lent, staged and scattered, succeeds with every sent byte
    in its slot, and no request compiles a kernel."""
    report = script_report(Path(__file__).with_name("staged_send_compiles.py"), "staged-repaged")
    assert report["registration"][0] == 0 and report["registration"][1] > 0, report
    scatter_thread = report["until_scatter_compiled"][0]
    assert scatter_thread and set(map(tuple, scatter_thread)) == {(SCATTER, SCATTER_THREAD)}
    assert report["until_scatter_compiled"][1] == []  # its first request staged: none compiled
    assert [request["lent"] for request in report["first"]] == [0, 1]
    assert [request["lent"] for request in report["second"]] == [1, 1]
    for request in report["first"] + report["second"]:
        assert request["staged_notes"] == 2 * request["lent"], request
        assert request["statuses"] == [0, 0, SUCCESS] and request["landed"], request
    assert report["second_page_sizes"] == [{"gather": [1], "scatter": [16]}] * 2
    assert report["new_in_second"] == [[], []]
