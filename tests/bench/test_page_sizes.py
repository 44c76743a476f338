"""The different-page-size benchmark at a tiny size, against a live peer engine in another process.

Every pair's three sends land each sent token's bytes in its decode slot (read
back from the peer), and the repaged send hands Mooncake exactly the
descriptors of the equal-page send of the same joint runs (and sglang's own
send of them): one per joint run per buffer, the runs counted by a token walk
here. No timing is asserted: speed is what the benchmark reports.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench import page_sizes


def test_token_walks_and_joint_runs():
    pages = np.array([3, 0, 1], dtype=np.int32)
    assert page_sizes.token_slots(pages, 4, 10).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 4, 5]
    src = page_sizes.token_slots(np.array([5, 6, 1]), 2, 6)  # 10 11 12 13 | 2 3
    dst = page_sizes.token_slots(np.array([0, 9]), 3, 6)  # 0 1 2 | 27 28 29
    assert page_sizes.joint_runs(src, dst) == 3  # breaks after tokens 2 (dst) and 3 (src)
    assert page_sizes.run_pages(1) == page_sizes.RUN_TOKENS
    assert page_sizes.run_pages(64) == page_sizes.RUN_PAGES
    pool = page_sizes.pool_tokens(4096, page_sizes.PAIRS)
    assert pool >= 4096 + page_sizes.SPARE_TOKENS and pool % 128 == 0


def test_the_repaged_send_lands_its_tokens_in_the_equal_sends_descriptors():
    buffers, tokens = 2, 256
    result = page_sizes.measure(tokens=tokens, buffers=buffers, budget_s=0.0, verify=True)

    assert [pair["name"] for pair in result["pairs"]] == ["16->64", "64->16", "16->1"]
    assert [pair["unit"] for pair in result["pairs"]] == [16, 16, 1]
    for pair in result["pairs"]:
        figures = pair["figures"]
        assert pair["landed_as_expected"] == dict.fromkeys(page_sizes.VARIANTS, True), pair["name"]
        assert figures["repaged"]["sends"] == figures["equal"]["sends"] == {"generic/arrays": 1}
        assert figures["sglang"]["sends"] == {}  # sglang's own send: the plugin counts nothing
        # Fragmented on both sides: more runs than pages of the larger size would give.
        assert pair["joint_runs"] > tokens // 64
        descriptors = [figures[variant]["descriptors"] for variant in page_sizes.VARIANTS]
        assert descriptors == [buffers * pair["joint_runs"]] * 3, pair["name"]
        nbytes = [figures[variant]["bytes"] for variant in page_sizes.VARIANTS]
        assert nbytes == [buffers * tokens * page_sizes.TOKEN_BYTES] * 3, pair["name"]
        for variant in page_sizes.VARIANTS:
            assert figures[variant]["repeats"] >= 2 and figures[variant]["median"] > 0
        assert pair["ratios"]["repaged/equal"] > 0
        assert pair["ratios"]["repaged/equal_paired"] > 0
        assert set(pair["repage_cpu_s"]) == {
            "chunk_for", "repaged_call", "unit_send", "transfer_entries", "check_token_bytes"
        }  # fmt: skip
        assert all(seconds > 0 for seconds in pair["repage_cpu_s"].values())
        steps = pair["steps_in_send_s"]
        assert steps["repaged"]["_repaged_call"] > 0 and steps["equal"]["_repaged_call"] == 0
        assert steps["equal"]["_plan"] > 0 and steps["repaged"]["total"] > 0
    assert "| 16->1 | 1 | " in page_sizes.table(result)
    assert "`_repaged_call`" in page_sizes.steps_table(result)
    assert result["target"]["met"] == all(pair["target_met"] for pair in result["pairs"])


def test_a_pair_whose_tokens_are_not_whole_pages_is_refused():
    with pytest.raises(ValueError, match="not whole pages of 64"):
        page_sizes.measure(tokens=96, buffers=1, budget_s=0.0, pairs=[(16, 64)])
