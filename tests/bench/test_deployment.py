"""bench.deployment's table and argument checks (its measurement runs on real servers in
tests/e2e/test_page16_arrays.py, which holds the same deployment)."""

from __future__ import annotations

import pytest

from bench.deployment import PREFILL_POOL_TOKENS, VARIANTS, format_results, main
from bench.harness import Timing


def _figures(seconds: float) -> dict:
    timing = Timing.from_samples([seconds, 2 * seconds, 3 * seconds]).as_dict()
    return {"ttft": timing, "transfer": timing, "plan": timing, "descriptors": 8.0}


def test_table_has_one_row_per_prompt_length():
    results = [
        {"prompt_tokens": 64, **{variant: _figures(0.01) for variant in VARIANTS}},
        {"prompt_tokens": 2048, **{variant: _figures(0.2) for variant in VARIANTS}},
    ]
    header, *rows = format_results(results).splitlines()
    assert header.split()[:2] == ["tokens", "descriptors"]
    assert [row.split()[0] for row in rows] == ["64", "2048"]
    assert "20.00ms [" in rows[0] and "400.00ms [" in rows[1]


def test_prompts_longer_than_the_pool_are_refused_before_any_server_starts(capsys):
    with pytest.raises(SystemExit):
        main(["--lengths", "64", str(PREFILL_POOL_TOKENS)])
    assert "do not fit the prefill pool" in capsys.readouterr().err
