"""Receive staging in real sglang servers: a 16-layer model, page 16, fragmented pools.

One deployment for every receive-staging scenario, in two phases (all seven
servers at once would need 15 GiB, above the suite's memory budget):

- decodes: `staging` (the plugin, its receive staging on), `killed` (the
  same, killed mid-transfer by the first phase's last test) and `plain`
  (`GPU_PLANNER_DISABLE=1`: sglang's own code);
- prefills: `staged` (the plugin, staging gate at 1 descriptor; the cost
  model instead in one test's window, `E2E_COST_MODEL_FLAG`), `plain`
  (`GPU_PLANNER_DISABLE=1`), `tp2` (the plugin, TP 2: each rank holds one
  of the model's two KV heads, a share of every decode token slot) and
  `pp2` (the plugin, two pipeline stages of 8 layers each).

The first phase runs the three decodes and the staged and plain prefills;
the second (the last two tests) stops `killed`, `staged` and `plain` prefill
and starts `tp2` and `pp2` beside the staging and plain decodes.

The plain prefill through the plain decode is plain sglang: its tokens are
what every TP 1 pairing must give. The staged prefill's fragmented sends of
32 KV buffers are gathered into the staging decode's region and scattered
there. Without the gate (the cost model decides, as in a prefill that sets no
`GPU_PLANNER_STAGING_*`) the same workload's one-page sends go direct and its
fragmented ones staged, with the same tokens. Either plugin peer paired with
a plain one keeps today's protocol and stages nothing. TP 2 -> 1 staged must
equal the same TP 2 prefill through the plain decode (not a TP 1 server: a
TP 2 prefill's all-reduce rounds bf16 otherwise). A PP 2 prefill's stages
each write some of the decode's buffers: sent direct, counted, plain
sglang's tokens (these two run last, in the second phase). The corruption
control leaves one staged page out of one scatter (test scaffolding) and the
tokens change. A request aborted on the decode while its staged note is
held: the note is dropped when it arrives, and the same room retried with as
many pages gives plain sglang's tokens. Then a decode killed while a staged
request is between its chunks: the prefill's request fails, and its next
requests to a healthy staging decode are staged and right.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import time
import uuid
from pathlib import Path

import pytest
import requests

from bench.servers.client import (
    REQUEST_TIMEOUT_S,
    Generation,
    generate_all,
    generate_pd,
    pd_payload,
    sampling,
    server_metrics,
)
from bench.servers.launcher import Server, servers_running, sglang_spec, stop_all
from tests.e2e.e2e_checks import assert_same_tokens
from tests.e2e.e2e_scenarios import (
    CHUNKED_PREFILL_TOKENS,
    CONCURRENCY,
    POOL_TOKENS,
    STAGING_CONTROL_PROMPT,
    STAGING_PROMPTS,
    prefill_spec,
)
from tests.e2e.scaffolding.e2e_sglang_scaffolding import (
    CORRUPT_SCATTER_FLAG_ENV,
    COST_MODEL_FLAG_ENV,
    HOLD_NOTE_FLAG_ENV,
    STALL_STAGED_FLAG_ENV,
)

pytestmark = pytest.mark.e2e

PAGE_SIZE = 16
BATCH_PAGES = 1024  # sglang's default: staging, not batch cuts, is what this module checks
PROMPTS = STAGING_PROMPTS[:-1]  # 12 mixed prompts (5 to 333 tokens); the last is the control
TP2_PROMPTS = PROMPTS[:6]  # TP 2 on two cores is slow
STAGED = {"GPU_PLANNER_STAGING_MIN_DESCRIPTORS": "1"}
PLAIN = {"GPU_PLANNER_DISABLE": "1"}
DEAD_PEER_FAILS_WITHIN_S = 120.0  # the prefill's request, once its decode is gone
PIPELINE_STAGE_DIRECT = (
    "gpu_planner:paths_chosen_total{path=direct,reason=the send writes only some of the "
    "decode's KV buffers (a pipeline stage)}"
)
PATHS_CHOSEN = "gpu_planner:paths_chosen_total{"
ABORT_ANSWERED_WITHIN_S = 60.0  # sglang's deferred release of aborted pages times out at 30 s


@dataclasses.dataclass
class Deployment:
    decodes: dict[str, Server]
    prefills: dict[str, Server]
    corrupt_flag: Path  # create it to corrupt the staging decode's next scatter
    stall_flag: Path  # create it to hold the staged prefill after its next staged send
    hold_flag: Path  # create it to hold the staged prefill's next note until `<flag>.go`
    cost_model_flag: Path  # while it exists, the cost model decides the staged prefill's sends
    phase_b_decode: dict[str, float] | None = None  # the staging decode's /metrics then

    def send(self, prefill: str, decode: str, prompts) -> list[Generation]:
        source, sink = self.prefills[prefill], self.decodes[decode]

        def one(ids):
            return generate_pd(source.url, source.bootstrap_port, sink.url, ids)

        return generate_all(one, prompts, CONCURRENCY)

    def staged_sends(self, prefill: str) -> float:
        """`gpu_planner:sends_total{hook=staged}` on a prefill's /metrics."""
        metrics = server_metrics(self.prefills[prefill].url)
        return sum(value for key, value in metrics.items() if "hook=staged" in key)


@pytest.fixture(scope="module")
def deployment(layered_model, server_logs, tmp_path_factory):
    flags = tmp_path_factory.mktemp("staging-flags")
    corrupt_flag, stall_flag = flags / "corrupt-next-scatter", flags / "stall-next-staged"
    hold_flag, cost_model_flag = flags / "hold-next-note", flags / "cost-model-decides"
    pool = ("--max-total-tokens", str(POOL_TOKENS))
    decode_env = {"staging": {CORRUPT_SCATTER_FLAG_ENV: str(corrupt_flag)}, "killed": {},
                  "plain": PLAIN}  # fmt: skip
    specs = [
        sglang_spec(f"{name}-decode", layered_model, PAGE_SIZE, "decode", *pool, env=env)
        for name, env in decode_env.items()
    ]
    specs += [
        prefill_spec(
            "staged-prefill", layered_model, PAGE_SIZE, BATCH_PAGES,
            {**STAGED, STALL_STAGED_FLAG_ENV: str(stall_flag), HOLD_NOTE_FLAG_ENV: str(hold_flag),
             COST_MODEL_FLAG_ENV: str(cost_model_flag)},
        ),
        prefill_spec("plain-prefill", layered_model, PAGE_SIZE, BATCH_PAGES, PLAIN),
    ]  # fmt: skip
    with servers_running(specs, server_logs) as servers:
        yield Deployment(
            {name: servers[f"{name}-decode"] for name in decode_env},
            {name: servers[f"{name}-prefill"] for name in ("staged", "plain")},
            corrupt_flag,
            stall_flag,
            hold_flag,
            cost_model_flag,
        )


@pytest.fixture(scope="module")
def phase_b(deployment, plain_tokens, layered_model, server_logs):
    """The module's second phase, for its last two tests: the TP 2 and PP 2 prefills, with
    the staging and plain decodes of the first phase still up (their metrics go on).

    The first phase's other servers (the `killed` decode, dead by now, and the staged and
    plain prefills: no later test sends through them) stop first, so the machine never
    holds all seven; plain sglang's tokens were taken before (`plain_tokens`). The two
    start together, inside the first phase's deployment (the machine's lock nests)."""
    stop_all([deployment.decodes.pop("killed"), *deployment.prefills.values()])
    deployment.prefills.clear()
    pool = ("--max-total-tokens", str(POOL_TOKENS))
    specs = [
        sglang_spec(
            "tp2-prefill", layered_model, PAGE_SIZE, "prefill", *pool, "--tp-size", "2",
            env={**STAGED, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        ),
        sglang_spec(
            "pp2-prefill", layered_model, PAGE_SIZE, "prefill", *pool, "--pp-size", "2",
            "--chunked-prefill-size", str(CHUNKED_PREFILL_TOKENS),
            env={**STAGED, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"},
        ),
    ]  # fmt: skip
    with servers_running(specs, server_logs) as servers:
        deployment.prefills.update({name: servers[f"{name}-prefill"] for name in ("tp2", "pp2")})
        deployment.phase_b_decode = server_metrics(deployment.decodes["staging"].url)
        yield deployment


@pytest.fixture(scope="module")
def plain_tokens(deployment) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Plain sglang's greedy tokens (plain prefill, plain decode) of every prompt here."""
    prompts = [*PROMPTS, STAGING_CONTROL_PROMPT]
    generations = deployment.send("plain", "plain", prompts)
    return {tuple(p): g.output_ids for p, g in zip(prompts, generations, strict=True)}


def test_staged_tokens_equal_plain_sglangs(deployment, plain_tokens):
    before = deployment.staged_sends("staged")
    generations = deployment.send("staged", "staging", PROMPTS)
    assert_same_tokens("staged", PROMPTS, generations, plain_tokens)
    staged = deployment.staged_sends("staged") - before
    assert staged >= len(PROMPTS)
    decode = server_metrics(deployment.decodes["staging"].url)
    assert decode["gpu_planner:staged_scatters_total"] >= staged, decode
    assert not [key for key in decode if "refused" in key], decode


def test_the_cost_model_sends_the_fragmented_workload_both_ways(deployment, plain_tokens):
    """Without the gate, as a prefill without `GPU_PLANNER_STAGING_*` sends: the cost model
    decides (the settings' seeds, a fresh model for the window, learning from its own sends).
    The workload has both shapes: one-page sends (32 descriptors of 1 KiB) and chunks of 2-5
    runs per buffer (64-160 descriptors). Direct: the first one-page sends, priced at the seeds
    before any direct send is learned from (a staged price only rises from what staged sends
    take here). Staged: the fragmented ones, priced below direct from about 48 descriptors at
    today's seeds and from fewer once the direct sends' times here (5-270 ms, measured with
    seven servers on two cores) are learned (with the seeds before, 4.5 ms staged and 15 us a
    request, it learned that alone). Plain sglang's tokens either way, every staged send scattered.

    The staged prefill's gate is set aside by the scaffolding's cost-model window, not by an
    sixth server in this phase (the machine's memory budget); one pass, since a model
    that learned an outlier may stage every send of a second (a probe only once in 64)."""
    prefill, decode = deployment.prefills["staged"].url, deployment.decodes["staging"].url
    before, decode_before = server_metrics(prefill), server_metrics(decode)
    deployment.cost_model_flag.touch()
    try:
        generations = deployment.send("staged", "staging", PROMPTS)
    finally:
        deployment.cost_model_flag.unlink()
    assert_same_tokens("the cost model's paths", PROMPTS, generations, plain_tokens)
    after, decode_after = server_metrics(prefill), server_metrics(decode)
    chosen = _rise(before, after, PATHS_CHOSEN)
    seen = {"chosen": chosen, "timed": _rise(before, after, "gpu_planner:path_")}
    assert chosen and not [key for key in chosen if "gate" in key], seen  # the model's reasons
    by_path = {
        path: sum(n for key, n in chosen.items() if key.startswith(f"{PATHS_CHOSEN}path={path},"))
        for path in ("direct", "staged")
    }
    assert by_path["direct"] > 0 and by_path["staged"] > 0, seen
    staged = sum(n for key, n in _rise(before, after, "gpu_planner:sends_total{").items()
                 if "hook=staged" in key)  # fmt: skip
    assert 0 < staged == by_path["staged"], (staged, seen)  # counted once, as the path taken
    scatters = "gpu_planner:staged_scatters_total"
    assert decode_after[scatters] - decode_before[scatters] >= staged, decode_after
    assert not [key for key in decode_after if "refused" in key], decode_after


def test_a_plain_prefill_to_a_staging_decode_keeps_todays_protocol(deployment, plain_tokens):
    scatters = server_metrics(deployment.decodes["staging"].url)
    generations = deployment.send("plain", "staging", PROMPTS)
    assert_same_tokens("plain prefill", PROMPTS, generations, plain_tokens)
    assert server_metrics(deployment.prefills["plain"].url) == {}
    decode = server_metrics(deployment.decodes["staging"].url)
    assert (
        decode["gpu_planner:staged_scatters_total"] == scatters["gpu_planner:staged_scatters_total"]
    )


def test_a_plugin_prefill_to_a_plain_decode_stages_nothing(deployment, plain_tokens):
    before = deployment.staged_sends("staged")
    generations = deployment.send("staged", "plain", TP2_PROMPTS)
    assert_same_tokens("plugin prefill", TP2_PROMPTS, generations, plain_tokens)
    assert deployment.staged_sends("staged") == before
    assert server_metrics(deployment.decodes["plain"].url) == {}


def test_a_skipped_scatter_changes_the_tokens(deployment, plain_tokens):
    """The control: one staged page never scattered, other tokens; the next request is right."""
    expected = plain_tokens[tuple(STAGING_CONTROL_PROMPT)]
    deployment.corrupt_flag.touch()
    [corrupted] = deployment.send("staged", "staging", [STAGING_CONTROL_PROMPT])
    assert not deployment.corrupt_flag.exists(), "the scaffolding did not take the flag"
    assert corrupted.output_ids[0] == expected[0]  # the prefill's own token
    assert corrupted.output_ids[1:] != expected[1:]
    [clean] = deployment.send("staged", "staging", [STAGING_CONTROL_PROMPT])
    assert clean.output_ids == expected


def test_a_room_retried_after_an_abort_is_token_identical(deployment, plain_tokens):
    """A staged request of room R is aborted on the decode while its first chunk is written and
    its note held; the note then arrives for an ended lending and is dropped, not scattered.
    The same prompt again with room R (as many pages: what a router's retry sends) is staged
    into a lending of its own and gives plain sglang's tokens."""
    prefill, decode = deployment.prefills["staged"], deployment.decodes["staging"]
    prompt, room = STAGING_CONTROL_PROMPT, random.getrandbits(63)
    payload = {**pd_payload(prompt, prefill.bootstrap_port, room), "rid": uuid.uuid4().hex}
    hold = deployment.hold_flag
    written, go = Path(f"{hold}.written"), Path(f"{hold}.go")
    before, released = server_metrics(decode.url), _released(decode.url)
    hold.touch()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill_reply = pool.submit(_post_reply, prefill.url, payload)
        decode_reply = pool.submit(_post_reply, decode.url, payload)
        try:
            _wait_for(
                written.exists, "the staged prefill never wrote the first chunk", prefill_reply
            )
            aborted = requests.post(
                decode.url + "/abort_request", json={"rid": payload["rid"]}, timeout=30
            )
            assert aborted.status_code == 200, aborted.text
            decode_status, decode_body = decode_reply.result(timeout=ABORT_ANSWERED_WITHIN_S)
        finally:
            go.touch()  # the held note goes to the decode, for a lending that has ended
        # The prefill may have failed the request already (the decode's abort reached it):
        # its thread goes on once the scaffolding took `go`.
        _wait_for(lambda: not go.exists(), "the held note never went", timeout_s=REQUEST_TIMEOUT_S)
        prefill_reply.result(timeout=DEAD_PEER_FAILS_WITHIN_S)
    written.unlink()
    assert not hold.exists(), "the scaffolding did not take the flag"
    assert _aborted(decode_status, decode_body), (decode_status, decode_body)
    dropped = "gpu_planner:receive_staging_fallbacks_total{reason=staged note for no live lending}"
    assert before.get(dropped, 0) == 0, before  # no earlier test's note was dropped
    _wait_for(
        lambda: (
            _released(decode.url) > released
            and server_metrics(decode.url).get(dropped, 0) > before.get(dropped, 0)
        ),
        "the decode neither dropped the held note nor released the aborted request's pages",
        timeout_s=ABORT_ANSWERED_WITHIN_S,
    )
    after_abort = server_metrics(decode.url)
    assert after_abort[dropped] - before.get(dropped, 0) == 1, after_abort
    scatters = "gpu_planner:staged_scatters_total"
    assert after_abort[scatters] == before[scatters], "the aborted request's note was scattered"

    sends = deployment.staged_sends("staged")
    retried = generate_pd(
        prefill.url, prefill.bootstrap_port, decode.url, prompt, bootstrap_room=room
    )
    assert retried.output_ids == plain_tokens[tuple(prompt)], (retried.output_ids, room)
    assert deployment.staged_sends("staged") > sends, "the retried request was not staged"
    after = server_metrics(decode.url)
    assert after[scatters] > after_abort[scatters], after
    assert after[dropped] == after_abort[dropped], after
    assert not [key for key in after if "refused" in key or "malformed" in key], after


def test_a_decode_killed_mid_transfer_fails_the_request_and_spares_the_next(
    deployment, plain_tokens
):
    """The staged prefill writes the first chunk of a 2-chunk request to `killed`, which is
    then killed: the request fails within a bound, and the prefill goes on staging to others."""
    prefill, doomed = deployment.prefills["staged"], deployment.decodes["killed"]
    payload = {
        "input_ids": list(STAGING_CONTROL_PROMPT),
        "sampling_params": sampling(),
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }
    written = Path(f"{deployment.stall_flag}.written")
    deployment.stall_flag.touch()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill_reply = pool.submit(_post_reply, prefill.url, payload)
        decode_reply = pool.submit(_post_reply, doomed.url, payload)
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while not written.exists():
            assert time.monotonic() < deadline, "the staged prefill never wrote the first chunk"
            assert not prefill_reply.done(), prefill_reply.result()
            time.sleep(0.05)
        doomed.kill()
        Path(f"{deployment.stall_flag}.go").touch()
        status, body = prefill_reply.result(timeout=DEAD_PEER_FAILS_WITHIN_S)  # fails in bound
        decode_status, _ = decode_reply.result()
    assert decode_status is None  # the killed decode never answered
    finish = body.get("meta_info", {}).get("finish_reason", {}) if isinstance(body, dict) else {}
    assert status != 200 or finish.get("type") == "abort", (status, body)
    before = deployment.staged_sends("staged")
    generations = deployment.send("staged", "staging", TP2_PROMPTS)
    assert_same_tokens("after the kill", TP2_PROMPTS, generations, plain_tokens)
    assert deployment.staged_sends("staged") - before >= len(TP2_PROMPTS)
    prefill_metrics = server_metrics(prefill.url)
    assert not [key for key in prefill_metrics if "lent to other sends" in key], prefill_metrics


def test_tp_down_staged_tokens_equal_the_same_prefill_through_a_plain_decode(phase_b):
    todays = phase_b.send("tp2", "plain", TP2_PROMPTS)
    assert phase_b.staged_sends("tp2") == 0
    before = server_metrics(phase_b.decodes["staging"].url)["gpu_planner:staged_scatters_total"]
    generations = phase_b.send("tp2", "staging", TP2_PROMPTS)
    differ = [
        (len(prompt), got.output_ids, want.output_ids)
        for prompt, got, want in zip(TP2_PROMPTS, generations, todays, strict=True)
        if got.output_ids != want.output_ids
    ]
    assert not differ, f"TP 2 -> 1 staged: (length, staged, today's): {differ}"
    assert phase_b.staged_sends("tp2") >= len(TP2_PROMPTS)
    decode = server_metrics(phase_b.decodes["staging"].url)
    assert decode["gpu_planner:staged_scatters_total"] > before, decode


def test_a_pipeline_prefill_is_sent_direct_and_token_identical(phase_b, plain_tokens):
    """PP 2 -> 1: each stage writes only its own layers' buffers, which a staged note cannot
    name (it covers every decode buffer); both stages send as planned, counted, and the
    tokens are plain sglang's (a pipeline splits layers, not heads: no all-reduce)."""
    prefill = phase_b.prefills["pp2"].url
    before = server_metrics(phase_b.decodes["staging"].url)
    generations = phase_b.send("pp2", "staging", TP2_PROMPTS)
    assert_same_tokens("PP 2 -> 1", TP2_PROMPTS, generations, plain_tokens)
    metrics = server_metrics(prefill)
    assert phase_b.staged_sends("pp2") == 0, metrics
    assert metrics.get(PIPELINE_STAGE_DIRECT, 0) >= 2 * len(TP2_PROMPTS), metrics
    decode = server_metrics(phase_b.decodes["staging"].url)
    scatters = "gpu_planner:staged_scatters_total"
    assert decode[scatters] == before[scatters], decode
    assert not [key for key in decode if "refused" in key], decode
    # Since the second phase began (TP 2 and PP 2 only): no note dropped for want of a lending
    # (the retried-room test, before, dropped its held one; it found none dropped before it).
    risen = _rise(phase_b.phase_b_decode, decode, "gpu_planner:")
    assert not [key for key in risen if "no live lending" in key], (risen, decode)


def _post_reply(url: str, payload: dict) -> tuple[int | None, object]:
    """(HTTP status, JSON body or text) of a /generate; (None, the error) if the server died."""
    try:
        response = requests.post(url + "/generate", json=payload, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as error:
        return None, error
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def _wait_for(condition, message: str, reply=None, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
    """Poll `condition` every 50 ms until it holds; fail with `message` after `timeout_s`, or
    at once with the reply's result if `reply` (a request's future) ended before it held."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        assert reply is None or not reply.done(), (message, reply.result())
        time.sleep(0.05)


def _aborted(status: int | None, body: object) -> bool:
    """Whether a /generate reply says its request was aborted (sglang answers 200 or an error)."""
    finish = body.get("meta_info", {}).get("finish_reason", {}) if isinstance(body, dict) else {}
    return status is not None and (status != 200 or finish.get("type") == "abort")


def _rise(before: dict[str, float], after: dict[str, float], prefix: str) -> dict[str, float]:
    """How much each sample starting with `prefix` rose from `before` to `after` (the risen)."""
    rise = {key: value - before.get(key, 0.0) for key, value in after.items()}
    return {key: value for key, value in rise.items() if key.startswith(prefix) and value}


RELEASED = "sglang:decode_deferred_kv_release_total"


def _released(url: str) -> float:
    """Aborted requests whose pages the decode released (sglang's deferred release: once the
    prefill acknowledged that its writes drained, or timed out): then the room is cleared."""
    samples = server_metrics(url, prefix=RELEASED)
    return sum(value for key, value in samples.items() if key.startswith(RELEASED + "{"))
