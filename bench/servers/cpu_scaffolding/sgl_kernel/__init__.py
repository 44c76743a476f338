"""CPU SCAFFOLDING, not product code: a stand-in for sglang's CPU kernel package.

sglang's CPU kernels (the `sgl-kernel` CPU build) are not on PyPI. With
`SGLANG_USE_CPU_ENGINE=1`, sglang 0.5.23 imports CPU kernels from `sgl_kernel`
at start-up (`srt/mem_cache/allocation.py`, `kernels/ops/kvcache/cache_move.py`,
`kernels/ops/speculative/spec_tree.py`, ...). The launcher
(`bench.servers.launcher`) puts this folder on every server's PYTHONPATH so
those imports succeed. Only `assign_req_to_token_pool_cpu` is ever called for
a small Llama without speculative decoding, so only it is implemented (in plain
torch, with the semantics of sglang's Triton kernel `assign_req_to_token_pool`);
every other name imports as a function that raises `NotImplementedError` naming
itself, so a server that reaches one fails loudly.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its `req_to_token` row, in batch order.

    Request `i` takes the next `end_offset[i] - start_offset[i]` slots of
    `out_cache_loc` into `req_to_token[req_pool_indices[i], start:end]`.
    """
    del pool_len  # the row length; the rows are indexed directly here
    taken = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count]
        taken += count


def __getattr__(name: str) -> object:
    """Any other kernel sglang imports: a function that refuses loudly when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing_kernel(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(f"CPU scaffolding: sgl_kernel.{name} has no stand-in")

    missing_kernel.__name__ = name
    return missing_kernel
