"""A tiny random Llama, written at run time from a fixed seed: no download.

Two layers (or as many as asked), grouped-query attention (4 query heads, 2 KV heads of 16 dims,
or as many KV heads as asked), a 512-token vocabulary, bfloat16 safetensors. On a CPU, sglang
pads the heads of a TP size that does not divide them (`adjust_config_with_unaligned_cpu_tp`:
1 KV head at TP 2 becomes 2, one of them zero weights) instead of replicating them, so a
TP 2 server of a 1-KV-head model holds no replicas, and its rank 1 sends the padding head's
KV over the real one's (sglang's own PD then gives other tokens from run to run).
The servers run with `--skip-tokenizer-init` and take token ids, so no tokenizer is
written. The weights are drawn wider than Hugging Face's default (std 0.5, not 0.02) so
the greedy next token has a clear margin and a wrong KV page changes it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 512
MAX_POSITIONS = 4096


def write_tiny_llama(folder: Path, seed: int = 0, layers: int = 2, kv_heads: int = 2) -> Path:
    """Write the model, with `layers` decoder layers and `kv_heads` KV heads (1, 2 or 4), to
    `folder` and return it."""
    if kv_heads not in (1, 2, 4):
        raise ValueError(f"{kv_heads} KV heads: the model's 4 query heads need 1, 2 or 4")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
