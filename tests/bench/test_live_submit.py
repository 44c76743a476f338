"""Mooncake's own submit and wire time: real engines in two processes, one layer's call.

No timing is asserted: the figures are what the benchmark reports.
"""

from __future__ import annotations

from bench.live_submit import measure


def test_a_live_peer_takes_the_whole_batch():
    figures = measure(num_descriptors=64, repeats=1)  # raises unless the batch completes
    assert figures["descriptors"] == 64
    for stage in ("submit_s", "wire_s", "refused_s"):
        assert figures[stage] > 0
    assert figures["submit_ns_per_descriptor"] == figures["submit_s"] / 64 * 1e9
