"""The head-sliced send-path benchmark runs both sends into a real, refused Mooncake engine.

No timing is asserted: the figures are what the benchmark reports.
"""

from __future__ import annotations

from test_bench_smoke import TINY_POLICY

from bench.send_path import send_path_available
from bench.slice_path import (
    ArraysRefusalAsSuccess,
    RefusalAsSuccess,
    SlicePathBench,
    refusal_as_success,
)


def test_both_slice_sends_run_every_layer_and_are_watched():
    missing = send_path_available()
    assert missing is None, f"the test environment has sglang and Mooncake: {missing}"
    bench = SlicePathBench()
    bench.prepare(num_tokens=256)
    figures = bench.measure(TINY_POLICY)
    assert figures["handoff"] == "arrays"  # the test environment's Mooncake 0.3.14
    assert figures["status"] == 0  # every refused call reported as sent: all layers ran
    for variant in ("sglang", "hooked"):
        assert figures[variant]["repeats"] == 1
        assert figures[variant]["gil_hold"]["calls"] == 1
    assert figures["speedup"] > 0


class ListOnlyEngine:
    def batch_transfer_sync_write(self, *args) -> int:
        return -1


class ArraysEngine(ListOnlyEngine):
    def batch_transfer_sync_write_arrays(self, *args) -> int:
        return -1


def test_the_proxy_has_the_write_methods_of_its_engine():
    """The hook picks arrays or lists by the engine's class: the proxy must not add arrays."""
    lists = refusal_as_success(ListOnlyEngine())
    assert type(lists) is RefusalAsSuccess
    assert not hasattr(lists, "batch_transfer_sync_write_arrays")
    assert lists.batch_transfer_sync_write("peer", [1], [2], [3]) == 0
    arrays = refusal_as_success(ArraysEngine())
    assert type(arrays) is ArraysRefusalAsSuccess
    assert arrays.batch_transfer_sync_write_arrays("peer", [1], [2], [3]) == 0
