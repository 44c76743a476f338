"""The receive-staging benchmarks at tiny sizes, against a live peer engine in another process.

Every variant runs; each lands exactly the source pages (slices) in the
peer's KV buffers, read back (the staged ones once their staging is
scattered here); the staged sends hand Mooncake the same bytes in fewer
descriptors. No timing is asserted: speed is what the benchmarks report.
"""

from __future__ import annotations

import time

import pytest

from bench import gathered_slice, staged_send
from bench.live_submit import live_peer


def test_the_staged_generic_send_lands_the_same_bytes_in_fewer_descriptors():
    result = staged_send.measure(num_pages=8, buffers=3, budget_s=0.0, verify=True)

    figures = result["figures"]
    assert result["landed_as_expected"] == dict.fromkeys(staged_send.VARIANTS, True)
    for name in (*staged_send.VARIANTS, "scatter", "wire"):
        assert figures[name]["repeats"] >= 2, name
    assert figures["sglang"]["sends"] == {}  # sglang's own send: the plugin counts nothing
    assert figures["hook"]["sends"] == {"generic/arrays": 1}
    assert figures["staged"]["sends"] == {"staged/arrays": 1}
    nbytes = 8 * 3 * staged_send.ITEM_LEN
    assert [figures[name]["bytes"] for name in staged_send.VARIANTS] == [nbytes] * 4
    assert figures["hook"]["descriptors"] == figures["sglang"]["descriptors"] == 3 * 4  # runs of 2
    assert figures["staged"]["descriptors"] == figures["staged"]["chunks"] == 1
    assert result["staged_with_scatter_s"] > result["staged_wall_s"] > 0
    assert result["ratios"]["hook/staged_with_scatter"] > 0
    # The defaults' choice: the seeds price 12 descriptors of 36 KiB faster direct, and the
    # run goes direct unless what its sends took taught the model otherwise (a loaded machine
    # can make direct sends slow enough): the choice follows the model's prices.
    assert seeded_path(12, nbytes, 1) == "direct"
    assert result["chosen_path"] == "direct" or model_path(result) == "staged"
    assert figures["chosen"]["sends"] in ({"generic/arrays": 1}, {"staged/arrays": 1})
    # The chosen figure adds the scatter to the sends that staged, none where every timed send
    # went direct; a probe may stage one (when is timing), so each sample gains 0 or one scatter
    # and the median moves by 0 to one scatter (1e-9: the two medians round differently).
    chosen_s, with_scatter_s = figures["chosen"]["median"], result["chosen_with_scatter_s"]
    if figures["chosen"]["paths"]["staged"] == 0:
        assert with_scatter_s == pytest.approx(chosen_s)
    assert chosen_s * (1 - 1e-9) <= with_scatter_s <= (chosen_s + result["scatter_s"]) * (1 + 1e-9)


def seeded_path(descriptors: int, nbytes: int, pieces: int) -> str:
    """The path the plugin's seeds price cheaper for a send of this shape (deterministic)."""
    from gpu_planner.integration.sglang.path_cost import Figures

    seeds = Figures.seeded()
    cheaper = seeds.staged_s(pieces, nbytes) < seeds.direct_s(descriptors, nbytes)
    return "staged" if cheaper else "direct"


def model_path(result: dict) -> str:
    """The path the run's model priced cheaper once the run ended."""
    return "staged" if result["model"]["staged_s"] < result["model"]["direct_s"] else "direct"


def test_the_default_send_stages_where_staging_wins_and_lands_sglangs_bytes():
    """1,024 descriptors of 2 KiB: direct pays a Mooncake request each (about 15-60 us on
    loopback TCP), staged one write (docs/benchmarks.md: about 10x faster here); the
    plugin's defaults stage it, and every send lands what sglang's own lands."""
    result = staged_send.measure(num_pages=64, buffers=32, budget_s=0.0, verify=True, item_len=1024)

    figures = result["figures"]
    assert result["descriptors"] == 32 * 32
    assert result["landed_as_expected"] == dict.fromkeys(staged_send.VARIANTS, True)
    nbytes = 32 * 32 * 1024
    pieces = -(-nbytes // result["slot_bytes"])
    assert seeded_path(32 * 32, nbytes, pieces) == "staged"  # the defaults' price
    assert result["chosen_path"] == "staged" or model_path(result) == "direct"
    assert figures["chosen"]["sends"] in ({"generic/arrays": 1}, {"staged/arrays": 1})


def test_the_chosen_send_stages_where_the_model_prices_staging_faster(monkeypatch):
    monkeypatch.setenv("GPU_PLANNER_COST_STAGED_FIXED_US", "0")  # seeds: staging is cheaper
    monkeypatch.setenv("GPU_PLANNER_COST_REQUEST_US", "1000")
    monkeypatch.setenv("GPU_PLANNER_STAGING_MIN_DESCRIPTORS", "100000")  # unset for the run
    # No probes: here direct is in fact faster, and once the staged sends have pulled direct's
    # price to within 5x of staging's, a young path's probe finds that out (as it should) and
    # the rest of the run goes direct; whether that happens within the run is timing.
    monkeypatch.setenv("GPU_PLANNER_COST_PROBE_INTERVAL", "0")
    result = staged_send.measure(num_pages=8, buffers=3, budget_s=0.0, verify=True)

    figures = result["figures"]
    assert result["landed_as_expected"] == dict.fromkeys(staged_send.VARIANTS, True)
    assert result["chosen_path"] == "staged"
    assert figures["chosen"]["sends"] == {"staged/arrays": 1}
    assert figures["chosen"]["descriptors"] == 1
    expected = figures["chosen"]["median"] + result["scatter_s"]  # every timed send staged
    assert result["chosen_with_scatter_s"] == pytest.approx(expected)
    low, high = result["chosen_with_scatter_p10_p90_s"]  # the same sends' spread, scatter added
    assert low == pytest.approx(figures["chosen"]["p10"] + result["scatter_s"])
    assert high == pytest.approx(figures["chosen"]["p90"] + result["scatter_s"])


def test_the_staged_tp_down_slice_send_writes_one_share_of_each_slot_in_fewer_descriptors(
    monkeypatch,
):
    monkeypatch.setenv("GPU_PLANNER_STAGING_MIN_DESCRIPTORS", "1")  # the gate stages it, as the CLI
    figures = gathered_slice.measure(
        "tp4_to_tp2", layers=1, num_tokens=128, budget_s=0.0, verify=True
    )

    variants = ("sglang", "per_token", "pages", "staged")
    assert figures["landed_as_expected"] == dict.fromkeys(variants, True)
    staged = figures["staged"]
    assert staged["sends"] == {"staged/arrays": 1}
    assert (staged["writers"], staged["writer"]) == (2, 1)  # prefill rank 1 of 4, decode TP 2
    assert staged["bytes"] == figures["sglang"]["bytes"] == figures["per_token"]["bytes"]
    assert staged["descriptors"] == staged["chunks"] == 1
    assert figures["per_token"]["descriptors"] == 2 * 128  # K and V, one per token
    assert figures["scatter"]["repeats"] >= 2
    assert figures["sglang/staged_with_scatter"] > 0


def test_the_sweep_shapes_its_points_and_writes_a_table_and_a_plot(tmp_path):
    from bench import staged_sweep

    assert staged_sweep.sweep_shape(32, 1024) == (32, 2, 512)  # runs of 2 pages per descriptor
    assert staged_sweep.sweep_shape(8192, 65536) == (32, 512, 32768)
    with pytest.raises(ValueError, match="no sweep shape"):
        staged_sweep.sweep_shape(8, 1024)
    result = staged_sweep.run_shape(32, 2, 512, budget_s=0.0)
    assert result["descriptors"] == 32 and result["mean_descriptor_bytes"] == 1024
    assert set(result["checks"]) == {"within_fastest", "not_slower_than_sglang"}
    table = staged_sweep.table([result])
    assert "| 32 x 1 KiB | " in table and f"| {result['chosen_path']} |" in table
    png = tmp_path / "sweep.png"
    staged_sweep.write_plot(png, [result])
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_sweep_pairs_sglang_and_chosen_only_where_both_were_sampled_alike():
    from bench import staged_sweep

    def result(sglang_repeats: int, chosen_repeats: int, step: int = 1) -> dict:
        figures = {
            name: {"repeats": repeats, "rounds": [(i * step, 1e-3) for i in range(repeats)]}
            for name, repeats in (("sglang", sglang_repeats), ("chosen", chosen_repeats))
        }
        figures["chosen"]["rounds"] = [(i, 1e-3) for i in range(chosen_repeats)]
        ratios = {"sglang/chosen": 1.10, "sglang/chosen_paired": 0.90}
        return {"figures": figures, "ratios": ratios}

    assert staged_sweep.sglang_over_chosen(result(400, 330)) == (0.90, True)
    assert staged_sweep.sglang_over_chosen(result(5, 38)) == (1.10, False)  # few rounds pair
    unpaired = result(400, 400)
    unpaired["ratios"]["sglang/chosen_paired"] = None  # no round in common
    assert staged_sweep.sglang_over_chosen(unpaired) == (1.10, False)
    # as many samples, but in different rounds (sglang's every 7th): few pairs, medians
    assert staged_sweep.sglang_over_chosen(result(10, 11, step=7)) == (1.10, False)


def test_the_chosen_sends_timed_are_the_choices_before_the_watched_ones():
    history = ["direct", "direct"] + ["staged", "direct", "staged"] + ["direct"] * 3
    assert staged_send._timed_paths(history, 3) == ["staged", "direct", "staged"]
    with pytest.raises(RuntimeError, match="choices for 40 timed"):
        staged_send._timed_paths(history, 40)


def test_what_the_model_learns_of_a_staged_send_includes_its_note():
    """A staged send's observation runs from the choice to its note (everything staging adds
    to the send): a note that takes 50 ms is in it."""
    from gpu_planner.integration.mooncake.engine import (
        QUIET_ENV,
        TCP_ONLY_ENV,
        set_mooncake_defaults,
    )
    from gpu_planner.integration.sglang import path_cost, prefill_routes

    class Recording(path_cost.PathCosts):
        def observe(self, peer, path, requests, nbytes, seconds, ok=True):
            observed.append((path, seconds))
            return super().observe(peer, path, requests, nbytes, seconds, ok)

    observed: list[tuple[str, float]] = []
    set_mooncake_defaults(QUIET_ENV, TCP_ONLY_ENV)
    pages, buffers = 8, 3
    pool_pages = pages + staged_send.SPARE_PAGES
    peer_bytes = buffers * (pool_pages + pages) * staged_send.ITEM_LEN
    with staged_send.plugin_defaults(), live_peer(peer_bytes) as peer:
        bench = staged_send.StagedSendBench(pages, buffers, peer)
        keep_note = bench.manager._send_multipart_locked

        def slow_note(*args, **kwargs):
            time.sleep(0.05)
            return keep_note(*args, **kwargs)

        bench.manager._send_multipart_locked = slow_note
        costs = Recording(path_cost.Figures.seeded(), gate=staged_send.STAGE_EVERY_SEND)
        try:
            for _ in range(2):  # a peer's first staged send is not learned; both observed
                send = (bench._hooked, bench.staged_dst_pages, bench.offer.capability, costs)
                assert bench._send(*send) == 0
        finally:
            prefill_routes.ROUTES.forget()
    assert [path for path, _ in observed] == ["staged", "staged"]
    assert all(seconds >= 0.05 for _, seconds in observed)
