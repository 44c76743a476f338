"""A real sglang prefill/decode deployment with and without the plugin: TTFT and transfer time.

One decode server and two prefill servers that send to it over Mooncake (TCP
on 127.0.0.1), the same deployment as the e2e suite (`tests/e2e`, whose server
harness, tiny random Llama and CPU scaffolding this reuses): one prefill with
the plugin, one with `GPU_PLANNER_DISABLE=1` (sglang's own planning). Each
prompt length, up to what the prefill's KV pool holds, is sent `--repeats`
times to each prefill, one request at a time, the two prefills taking turns
(and turns about who goes first), each request a fresh prompt. Per request:

- `ttft`: from sending until decode streams the first token (client side);
- `transfer`: the prefill's own KV transfer time for the request, from the
  increase of sglang's `sglang:kv_transfer_latency_ms` histogram (transfer
  queue entry to completion, whole prompt in one chunk here);
- `plan`: the plugin's planning time (`gpu_planner:plan_seconds_total`), and
  `descriptors` handed to Mooncake (plugin prefill only).

On a CPU with TCP the model and Mooncake's transport dominate both figures;
the point is a real-deployment figure that a GPU run repeats (there sglang's
CPU scaffolding and CPU flags in `tests/e2e/e2e_servers.py` give way to the
GPU defaults). Run: `python -m bench.deployment [--lengths 64 1024 3584]
[--repeats 5]`; writes `bench/results/deployment.{json,png}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness import Timing
from bench.plot import write_panels
from bench.report import format_seconds, machine_info, write_json
from tests.e2e.e2e_client import first_token_pd, prompt_set, server_metrics
from tests.e2e.e2e_model import write_tiny_llama
from tests.e2e.e2e_servers import Server, ServerSpec, servers_running, sglang_spec

PAGE_SIZE = 16
PREFILL_POOL_TOKENS = 4096  # the longest prompt must fit, with room for its output
DECODE_POOL_TOKENS = 8192  # decode also reserves 512 tokens for running requests
DEFAULT_LENGTHS = (64, 256, 1024, 2048, 3584)
VARIANTS = ("plugin", "sglang")
TRANSFER_LATENCY = "sglang:kv_transfer_latency_ms"


@dataclasses.dataclass(frozen=True)
class Counts:
    """Cumulative counters of one prefill server, read from its /metrics."""

    transfers: float
    transfer_ms: float
    plan_s: float
    descriptors: float

    @classmethod
    def read(cls, prefill: Server) -> Counts:
        latency = server_metrics(prefill.url, TRANSFER_LATENCY)
        planner = server_metrics(prefill.url)
        return cls(
            transfers=sum(
                v for k, v in latency.items() if k.startswith(TRANSFER_LATENCY + "_count")
            ),
            transfer_ms=sum(
                v for k, v in latency.items() if k.startswith(TRANSFER_LATENCY + "_sum")
            ),
            plan_s=planner.get("gpu_planner:plan_seconds_total", 0.0),
            descriptors=planner.get("gpu_planner:descriptors_total", 0.0),
        )


def one_request(prefill: Server, decode: Server, prompt: Sequence[int]) -> dict[str, float]:
    """TTFT, transfer, plan seconds and descriptors of one request (nothing else in flight)."""
    before = Counts.read(prefill)
    ttft_s = first_token_pd(prefill.url, prefill.bootstrap_port, decode.url, prompt)
    deadline = time.monotonic() + 30
    while (after := Counts.read(prefill)).transfers == before.transfers:
        if time.monotonic() > deadline:  # the prefill observes it when the transfer completes
            raise TimeoutError(
                f"{prefill.name} recorded no transfer for a {len(prompt)}-token prompt"
            )
        time.sleep(0.05)
    if after.transfers != before.transfers + 1:
        raise RuntimeError(f"{prefill.name}: {after.transfers - before.transfers} transfers, not 1")
    return {
        "ttft": ttft_s,
        "transfer": (after.transfer_ms - before.transfer_ms) / 1e3,
        "plan": after.plan_s - before.plan_s,
        "descriptors": after.descriptors - before.descriptors,
    }


def measure(
    prefills: dict[str, Server], decode: Server, lengths: Sequence[int], repeats: int
) -> list[dict[str, Any]]:
    """Per prompt length and variant: Timing of ttft, transfer and plan; descriptors per request."""
    samples = {(n, v): [] for n in lengths for v in VARIANTS}
    for variant in VARIANTS:  # warm-up: the first requests of a server are slow
        one_request(prefills[variant], decode, prompt_set(seed=10**6, lengths=(64,))[0])
    for repeat in range(repeats):
        for length in lengths:
            [prompt] = prompt_set(seed=repeat * 100_000 + length, lengths=(length,))
            order = VARIANTS if (repeat + length) % 2 == 0 else VARIANTS[::-1]
            for variant in order:  # the same prompt: each prefill has its own prefix cache
                samples[length, variant].append(one_request(prefills[variant], decode, prompt))
    results = []
    for length in lengths:
        result: dict[str, Any] = {"prompt_tokens": length}
        for variant in VARIANTS:
            rows = samples[length, variant]
            result[variant] = {
                figure: Timing.from_samples([row[figure] for row in rows]).as_dict()
                for figure in ("ttft", "transfer", "plan")
            }
            result[variant]["descriptors"] = rows[0]["descriptors"]
        results.append(result)
    return results


def format_results(results: list[dict[str, Any]]) -> str:
    """A text table: one row per prompt length, medians [p10-p90] of both variants."""

    def cell(timing: dict[str, float]) -> str:
        spread = f"{format_seconds(timing['p10'])}-{format_seconds(timing['p90'])}"
        return f"{format_seconds(timing['median'])} [{spread}]"

    header = ["tokens", "descriptors", "TTFT plugin", "TTFT sglang", "transfer plugin",
              "transfer sglang", "plan (plugin)"]  # fmt: skip
    rows = [
        [
            str(r["prompt_tokens"]),
            f"{r['plugin']['descriptors']:.0f}",
            cell(r["plugin"]["ttft"]),
            cell(r["sglang"]["ttft"]),
            cell(r["plugin"]["transfer"]),
            cell(r["sglang"]["transfer"]),
            cell(r["plugin"]["plan"]),
        ]
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]
    )


def deployment_specs(model: Path) -> list[ServerSpec]:
    """Decode, the plugin's prefill and sglang's prefill (`GPU_PLANNER_DISABLE=1`)."""
    prefill_args = ("--max-total-tokens", str(PREFILL_POOL_TOKENS))
    prefill_args += ("--chunked-prefill-size", str(PREFILL_POOL_TOKENS))  # one transfer each
    decode_args = ("--max-total-tokens", str(DECODE_POOL_TOKENS))
    return [
        sglang_spec("decode", model, PAGE_SIZE, "decode", *decode_args),
        sglang_spec("plugin", model, PAGE_SIZE, "prefill", *prefill_args),
        sglang_spec(
            "sglang", model, PAGE_SIZE, "prefill", *prefill_args,
            env={"GPU_PLANNER_DISABLE": "1"},
        ),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.deployment", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    parser.add_argument("--name", default="deployment", help="stem of the JSON/PNG files")
    args = parser.parse_args(argv)
    too_long = [n for n in args.lengths if n > PREFILL_POOL_TOKENS - 64]
    if too_long:
        parser.error(
            f"prompt lengths {too_long} do not fit the prefill pool ({PREFILL_POOL_TOKENS})"
        )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-deployment-") as scratch:
        model = write_tiny_llama(Path(scratch) / "model", seed=0)
        logs = args.out / f"{args.name}-logs"
        logs.mkdir(parents=True, exist_ok=True)
        with servers_running(deployment_specs(model), logs) as servers:
            prefills = {variant: servers[variant] for variant in VARIANTS}
            results = measure(prefills, servers["decode"], args.lengths, args.repeats)
    duration_s = time.perf_counter() - started
    print(format_results(results))
    document = {
        "machine": machine_info(),
        "settings": {**{k: str(v) for k, v in vars(args).items()}, "page_size": PAGE_SIZE},
        "duration_s": duration_s,
        "results": results,
    }
    json_path, png_path = args.out / f"{args.name}.json", args.out / f"{args.name}.png"
    write_json(json_path, document)
    panels = {
        title: {
            variant: [(r["prompt_tokens"], r[variant][figure]) for r in results]
            for variant in VARIANTS
        }
        for figure, title in (("ttft", "time to first token"), ("transfer", "prefill KV transfer"))
    }
    write_panels(
        png_path, panels, f"sglang PD deployment on {document['machine']['cpu']}", "prompt tokens"
    )
    print(f"\n{len(args.lengths)} lengths x {args.repeats} repeats in {duration_s:.0f} s")
    print(f"server logs in {logs}")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
