"""The e2e suite's fixed prompts and deployment sizes, shared by the tests and the reference.

Every scenario sends the same mixed-length prompts (5 to 900 tokens, several
sharing a 96-token prefix so the prefill's radix cache hits) at a concurrency
above what the small KV pools hold at once, so requests queue, finish out of
order and free pages in scattered places: page lists fragment on both sides.
`CONTROL_PROMPT` is long enough to span several pages at every page size, so
reversing its decode pages (the corruption control) moves its KV.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.servers.client import prompt_set
from bench.servers.launcher import ServerSpec, sglang_spec

MIXED_LENGTHS = (
    5, 17, 40, 64, 90, 97, 120, 150, 200, 260, 300, 333,
    410, 480, 520, 600, 650, 700, 777, 800, 850, 900, 31, 128,
)  # fmt: skip
MIXED_PROMPTS = prompt_set(seed=1, lengths=MIXED_LENGTHS, shared_prefix=96)
CONTROL_PROMPT = prompt_set(seed=2, lengths=(700,))[0]
ALL_PROMPTS = (*MIXED_PROMPTS, CONTROL_PROMPT)
CONCURRENCY = 8
# The receive-staging modules' prompts (a 16-layer model is slower): mixed lengths with
# shared prefixes, and a control prompt for the skipped-scatter check.
STAGING_CONTROL_PROMPT = prompt_set(seed=4, lengths=(400,))[0]
STAGING_PROMPTS = (*MIXED_PROMPTS[:12], STAGING_CONTROL_PROMPT)

POOL_TOKENS = 2048  # --max-total-tokens: a few of the longest prompts fill it
CHUNKED_PREFILL_TOKENS = 256  # prompts above it reach decode in several transfers
# Mooncake 0.3.13 (list API only), installed by scripts/setup.sh test beside the venv's
# 0.3.14; a server with this folder first on PYTHONPATH imports it instead.
MOONCAKE_0_3_13 = Path(sys.prefix) / "mooncake-0.3.13"


def decode_spec(
    name: str,
    model: Path,
    page_size: int,
    batch_pages: int,
    python_path: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> ServerSpec:
    """The decode server of a scenario: the small pool, receive staging off, `extra` flags.

    These scenarios check the hooks' own descriptors against sglang's;
    `test_staging_servers*.py` run decodes with their receive staging on.
    """
    return sglang_spec(
        name, model, page_size, "decode", "--max-total-tokens", str(POOL_TOKENS), *extra,
        env={**_batch_env(batch_pages), "GPU_PLANNER_RECEIVE_STAGING_BYTES": "0"},
        python_path=python_path,
    )  # fmt: skip


def prefill_spec(
    name: str,
    model: Path,
    page_size: int,
    batch_pages: int,
    env: dict[str, str] | None = None,
    python_path: tuple[str, ...] = (),
) -> ServerSpec:
    """A prefill server of a scenario: the small pool, chunked prefill, `batch_pages` per batch."""
    return sglang_spec(
        name, model, page_size, "prefill",
        "--max-total-tokens", str(POOL_TOKENS),
        "--chunked-prefill-size", str(CHUNKED_PREFILL_TOKENS),
        env={**_batch_env(batch_pages), **(env or {})},
        python_path=python_path,
    )  # fmt: skip


def _batch_env(batch_pages: int) -> dict[str, str]:
    return {"SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": str(batch_pages)}
