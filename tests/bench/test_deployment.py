"""bench.deployment's table and argument checks (its measurement runs on real servers in
tests/e2e/test_page16_arrays.py, which holds the same deployment)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.deployment import (
    PREFILL_POOL_TOKENS,
    VARIANT_ENV,
    VARIANTS,
    deployment_specs,
    format_results,
    main,
)
from bench.harness import Timing


def _figures(seconds: float) -> dict:
    timing = Timing.from_samples([seconds, 2 * seconds, 3 * seconds]).as_dict()
    return {"ttft": timing, "transfer": timing, "plan": timing, "descriptors": 8.0}


def test_table_has_one_row_per_prompt_length_and_variant():
    results = [
        {"prompt_tokens": 64, **{variant: _figures(0.01) for variant in VARIANTS}},
        {"prompt_tokens": 2048, **{variant: _figures(0.2) for variant in VARIANTS}},
    ]
    header, *rows = format_results(results).splitlines()
    assert header.split()[:3] == ["tokens", "variant", "descriptors"]
    assert [row.split()[:2] for row in rows] == [
        [str(tokens), variant] for tokens in (64, 2048) for variant in VARIANTS
    ]
    assert "20.00ms [" in rows[0] and "400.00ms [" in rows[-1]


def test_each_variant_prefill_gets_its_knobs_and_the_tp_size():
    specs = {spec.name: spec for spec in deployment_specs(Path("/model"), prefill_tp=2)}
    assert set(specs) == {"decode", *VARIANTS}
    assert "--tp-size" not in specs["decode"].args
    for variant in VARIANTS:
        args, env = specs[variant].args, dict(specs[variant].env)
        assert args[args.index("--tp-size") + 1] == "2"
        assert env.items() >= VARIANT_ENV[variant].items()
    assert dict(specs["sglang"].env)["GPU_PLANNER_DISABLE"] == "1"
    assert int(dict(specs["hook"].env)["GPU_PLANNER_STAGING_MIN_DESCRIPTORS"]) > 2**60


def test_prompts_longer_than_the_pool_are_refused_before_any_server_starts(capsys):
    with pytest.raises(SystemExit):
        main(["--lengths", "64", str(PREFILL_POOL_TOKENS)])
    assert "do not fit the prefill pool" in capsys.readouterr().err


def test_variants_picks_the_prefills_that_run():
    specs = deployment_specs(Path("/model"), prefill_tp=2, variants=("staged", "sglang"))
    assert [spec.name for spec in specs] == ["decode", "staged", "sglang"]
    with pytest.raises(SystemExit):
        main(["--variants", "staged", "nonsense"])
