"""Requests to the launched servers: greedy generations by token id, and the plugin's metrics.

A disaggregated request goes to a prefill and a decode server at once with the
same bootstrap room (what sglang's PD routers do); the tokens come from the
decode server. `prompt_set` builds the fixed prompts: mixed lengths, some
sharing a long prefix so the prefill's radix cache hits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import time
from collections.abc import Callable, Sequence

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.servers.tiny_model import VOCAB_SIZE

REQUEST_TIMEOUT_S = 300.0
MAX_NEW_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class Generation:
    """One request's output tokens and `meta_info` (and the prefill's, when disaggregated)."""

    output_ids: tuple[int, ...]
    meta: dict
    prefill_meta: dict | None = None


def sampling(max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    """Greedy, fixed length (EOS ignored), so every run generates the same number of tokens."""
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def _post(url: str, payload: dict) -> dict:
    response = requests.post(url + "/generate", json=payload, timeout=REQUEST_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"{url}/generate answered {response.status_code}: {response.text}")
    return response.json()


def generate(
    url: str, input_ids: Sequence[int], max_new_tokens: int = MAX_NEW_TOKENS
) -> Generation:
    """A request to one server (plain sglang, or the PD router)."""
    body = _post(url, {"input_ids": list(input_ids), "sampling_params": sampling(max_new_tokens)})
    return Generation(tuple(body["output_ids"]), body["meta_info"])


def generate_pd(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    input_ids: Sequence[int],
    max_new_tokens: int = MAX_NEW_TOKENS,
    bootstrap_room: int | None = None,
) -> Generation:
    """A disaggregated request: prefill and decode at once, one bootstrap room (random unless
    given: a router's retry reuses its room); decode's tokens."""
    payload = pd_payload(input_ids, bootstrap_port, bootstrap_room, max_new_tokens)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(_post, prefill_url, payload)
        decode = pool.submit(_post, decode_url, payload)
        prefill_body, body = prefill.result(), decode.result()
    return Generation(tuple(body["output_ids"]), body["meta_info"], prefill_body["meta_info"])


def pd_payload(
    input_ids: Sequence[int],
    bootstrap_port: int,
    bootstrap_room: int | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> dict:
    """The /generate body both servers of a disaggregated request get (a random room unless
    `bootstrap_room` is given)."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": sampling(max_new_tokens),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": random.getrandbits(63) if bootstrap_room is None else bootstrap_room,
    }


def first_token_pd(
    prefill_url: str, bootstrap_port: int, decode_url: str, input_ids: Sequence[int]
) -> float:
    """Seconds from sending a disaggregated request until decode streams its first token."""
    payload = pd_payload(input_ids, bootstrap_port, max_new_tokens=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.perf_counter()
        prefill = pool.submit(_post, prefill_url, payload)
        first_token_s = None
        with requests.post(
            decode_url + "/generate", json={**payload, "stream": True}, stream=True,
            timeout=REQUEST_TIMEOUT_S,
        ) as response:  # fmt: skip
            response.raise_for_status()
            for line in response.iter_lines():
                if first_token_s is None and line.startswith(b"data: {"):
                    first_token_s = time.perf_counter() - started
        prefill.result()
    if first_token_s is None:
        raise RuntimeError(f"{decode_url} streamed no token")
    return first_token_s


def generate_all(
    send: Callable[[Sequence[int]], Generation],
    prompts: Sequence[Sequence[int]],
    concurrency: int,
) -> list[Generation]:
    """`send` every prompt, `concurrency` at a time; results in prompt order."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(send, prompts))


def prompt_set(seed: int, lengths: Sequence[int], shared_prefix: int = 0) -> list[list[int]]:
    """Prompts of `lengths` tokens from `seed`; the first `shared_prefix` tokens are common."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, VOCAB_SIZE, shared_prefix).tolist()
    return [
        prefix[:length] + rng.integers(3, VOCAB_SIZE, max(length - shared_prefix, 0)).tolist()
        for length in lengths
    ]


def server_metrics(url: str, prefix: str = "gpu_planner:") -> dict[str, float]:
    """The samples on a server's /metrics whose name starts with `prefix`, keyed by name and
    labels, e.g. `gpu_planner:sends_total{handoff=arrays,hook=generic}`."""
    response = requests.get(url + "/metrics", timeout=30)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
