"""A real sglang prefill/decode deployment, staged, hooked and sglang's own: TTFT and transfer.

One decode server (the plugin, its receive staging on) and three prefill
servers that send to it over Mooncake (TCP on 127.0.0.1), the same deployment
as the e2e suite (`tests/e2e`), started by the same launcher with the same tiny
random Llama and CPU scaffolding (`bench.servers`):

- `staged`: the plugin at its defaults: a send that passes the staging gate
  goes through the decode's receive staging;
- `hook`: the plugin with staging out of reach
  (`GPU_PLANNER_STAGING_MIN_DESCRIPTORS` above any send): today's hooked send;
- `sglang`: `GPU_PLANNER_DISABLE=1`, sglang's own planning (a plain prefill
  to a plugin decode: sglang's protocol).

Each prompt length, up to what the prefill's KV pool holds, is sent
`--repeats` times to each prefill, one request at a time, the prefills taking
turns (and turns about who goes first), each request a fresh prompt. With
`--fragment`, each round starts with a burst of concurrent mixed-length
prompts (shared prefixes) through every prefill, whose radix cache then holds
pages all over its pool: the measured requests get fragmented page lists, as
a busy server's do. Per request:

- `ttft`: from sending until decode streams the first token (client side);
- `transfer`: the prefill's own KV transfer time for the request, from the
  increase of sglang's `sglang:kv_transfer_latency_ms` histogram (transfer
  queue entry to completion, whole prompt in one chunk here);
- `plan`: the plugin's planning time (`gpu_planner:plan_seconds_total`), and
  `descriptors` handed to Mooncake (plugin prefills only; a staged send
  counts one per piece).

`--layers` sets the model's depth (KV buffers = 2 x layers), `--prefill-tp 2`
runs every prefill at TP 2 (each rank a share of every decode token slot:
TP-down). On a CPU with TCP the model and Mooncake's transport dominate both
figures; the point is a real-deployment figure that a GPU run repeats (there
sglang's CPU scaffolding and CPU flags in `bench/servers/launcher.py` give way
to the GPU defaults). Its servers wait for any other deployment on the machine
(an e2e suite's) to stop first, and die with this process. Run:
`python -m bench.deployment [--lengths 64 1024 3584] [--repeats 5]
[--layers 16 --fragment] [--prefill-tp 2] [--variants staged sglang]`; writes
`bench/results/deployment.{json,png}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import Timing
from bench.plot import write_panels
from bench.report import format_seconds, machine_info, write_json
from bench.servers.client import (
    first_token_pd,
    generate_all,
    generate_pd,
    prompt_set,
    server_metrics,
)
from bench.servers.launcher import Server, ServerSpec, servers_running, sglang_spec
from bench.servers.tiny_model import write_tiny_llama

PAGE_SIZE = 16
PREFILL_POOL_TOKENS = 4096  # the longest prompt must fit, with room for its output
DECODE_POOL_TOKENS = 8192  # decode also reserves 512 tokens for running requests
DEFAULT_LENGTHS = (64, 256, 1024, 2048, 3584)
VARIANTS = ("staged", "hook", "sglang")
VARIANT_ENV = {
    "staged": {},
    "hook": {"GPU_PLANNER_STAGING_MIN_DESCRIPTORS": str(1 << 62)},
    "sglang": {"GPU_PLANNER_DISABLE": "1"},
}
# --fragment: the burst before each round (the e2e suite's mixed lengths and shared prefix)
FRAGMENT_LENGTHS = (5, 17, 40, 64, 90, 97, 120, 150, 200, 260, 300, 333, 410, 480, 31, 128)
FRAGMENT_PREFIX, FRAGMENT_CONCURRENCY = 96, 8
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


def one_request(
    prefill: Server, decode: Server, prompt: Sequence[int], ranks: int = 1
) -> dict[str, float]:
    """TTFT, transfer, plan seconds and descriptors of one request (nothing else in flight).

    Each of the prefill's `ranks` TP ranks records the request's transfer;
    `transfer` is their mean, `plan` and `descriptors` their sums.
    """
    before = Counts.read(prefill)
    ttft_s = first_token_pd(prefill.url, prefill.bootstrap_port, decode.url, prompt)
    deadline = time.monotonic() + 30
    while (after := Counts.read(prefill)).transfers < before.transfers + ranks:
        if time.monotonic() > deadline:  # the prefill observes it when the transfer completes
            raise TimeoutError(
                f"{prefill.name} recorded {after.transfers - before.transfers} of {ranks} "
                f"transfers for a {len(prompt)}-token prompt"
            )
        time.sleep(0.05)
    if after.transfers != before.transfers + ranks:
        raise RuntimeError(
            f"{prefill.name}: {after.transfers - before.transfers} transfers, not {ranks}"
        )
    return {
        "ttft": ttft_s,
        "transfer": (after.transfer_ms - before.transfer_ms) / 1e3 / ranks,
        "plan": after.plan_s - before.plan_s,
        "descriptors": after.descriptors - before.descriptors,
    }


def fragment(prefill: Server, decode: Server, seed: int) -> None:
    """A burst of concurrent mixed-length prompts through `prefill`: its radix cache keeps
    their pages, scattered over its pool, so the next requests' pages fragment."""
    prompts = prompt_set(seed=seed, lengths=FRAGMENT_LENGTHS, shared_prefix=FRAGMENT_PREFIX)

    def one(ids):
        return generate_pd(prefill.url, prefill.bootstrap_port, decode.url, ids)

    generate_all(one, prompts, FRAGMENT_CONCURRENCY)


def measure(
    prefills: dict[str, Server],
    decode: Server,
    lengths: Sequence[int],
    repeats: int,
    fragmented: bool = False,
    ranks: int = 1,
) -> list[dict[str, Any]]:
    """Per prompt length and variant: Timing of ttft, transfer and plan; descriptors per request
    (the median); with `fragmented`, a `fragment` burst through every prefill before each round."""
    variants = list(prefills)
    samples = {(n, v): [] for n in lengths for v in variants}
    for variant in variants:  # warm-up: the first requests of a server are slow
        one_request(prefills[variant], decode, prompt_set(seed=10**6, lengths=(64,))[0], ranks)
    for repeat in range(repeats):
        if fragmented:
            for variant in variants:  # the same burst for each
                fragment(prefills[variant], decode, seed=2 * 10**6 + repeat)
        for length in lengths:
            [prompt] = prompt_set(seed=repeat * 100_000 + length, lengths=(length,))
            order = variants if (repeat + length) % 2 == 0 else variants[::-1]
            for variant in order:  # the same prompt: each prefill has its own prefix cache
                sample = one_request(prefills[variant], decode, prompt, ranks)
                samples[length, variant].append(sample)
    results = []
    for length in lengths:
        result: dict[str, Any] = {"prompt_tokens": length}
        for variant in variants:
            rows = samples[length, variant]
            result[variant] = {
                figure: Timing.from_samples([row[figure] for row in rows]).as_dict()
                for figure in ("ttft", "transfer", "plan")
            }
            result[variant]["descriptors"] = float(np.median([row["descriptors"] for row in rows]))
        if {"staged", "sglang"} <= set(variants):
            staged = result["staged"]["transfer"]["median"]
            result["sglang/staged_transfer"] = result["sglang"]["transfer"]["median"] / staged
            if "hook" in variants:
                result["hook/staged_transfer"] = result["hook"]["transfer"]["median"] / staged
        results.append(result)
    return results


def format_results(results: list[dict[str, Any]]) -> str:
    """A text table: one row per prompt length and variant, medians [p10-p90]."""

    def cell(timing: dict[str, float]) -> str:
        spread = f"{format_seconds(timing['p10'])}-{format_seconds(timing['p90'])}"
        return f"{format_seconds(timing['median'])} [{spread}]"

    header = ["tokens", "variant", "descriptors", "TTFT", "transfer", "plan"]
    rows = []
    for result in results:
        for variant in (v for v in VARIANTS if v in result):
            figures = result[variant]
            rows.append([
                str(result["prompt_tokens"]), variant, f"{figures['descriptors']:.0f}",
                cell(figures["ttft"]), cell(figures["transfer"]), cell(figures["plan"]),
            ])  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *rows]
    )


def deployment_specs(
    model: Path, prefill_tp: int = 1, variants: Sequence[str] = VARIANTS
) -> list[ServerSpec]:
    """The decode (the plugin, receive staging on) and one prefill per variant."""
    prefill_args = ("--max-total-tokens", str(PREFILL_POOL_TOKENS))
    prefill_args += ("--chunked-prefill-size", str(PREFILL_POOL_TOKENS))  # one transfer each
    tp_env = {}
    if prefill_tp > 1:
        prefill_args += ("--tp-size", str(prefill_tp))
        tp_env = {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(map(str, range(prefill_tp)))}
    decode_args = ("--max-total-tokens", str(DECODE_POOL_TOKENS))
    return [
        sglang_spec("decode", model, PAGE_SIZE, "decode", *decode_args),
        *(
            sglang_spec(
                variant,
                model,
                PAGE_SIZE,
                "prefill",
                *prefill_args,
                env={**VARIANT_ENV[variant], **tp_env},
            )  # fmt: skip
            for variant in variants
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.deployment", description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny model")
    parser.add_argument("--prefill-tp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--fragment", action="store_true", help="a burst before each round")
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
        help="prefills to run (fewer servers: a TP 2 prefill keeps a core busy)",
    )  # fmt: skip
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
        model = write_tiny_llama(Path(scratch) / "model", seed=0, layers=args.layers)
        logs = args.out / f"{args.name}-logs"
        logs.mkdir(parents=True, exist_ok=True)
        variants = [variant for variant in VARIANTS if variant in args.variants]
        specs = deployment_specs(model, args.prefill_tp, variants)
        with servers_running(specs, logs) as servers:
            prefills = {variant: servers[variant] for variant in variants}
            results = measure(
                prefills, servers["decode"], args.lengths, args.repeats, args.fragment,
                args.prefill_tp,
            )  # fmt: skip
    duration_s = time.perf_counter() - started
    print(format_results(results))
    for result in results:
        ratios = {k: f"{v:.2f}x" for k, v in result.items() if k.endswith("_transfer")}
        print(f"{result['prompt_tokens']} tokens, transfer medians: {ratios}")
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
            for variant in variants
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
