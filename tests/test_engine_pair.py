"""The foundation: a real vLLM prefill/decode pair on CPU with real NIXL transfers."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LocalPair
from tests.engine_requests import (
    KV_BYTES_PER_TOKEN,
    PREFILL_PARAMS,
    NixlReads,
    chat,
    long_prompt,
    metric_total,
    single_engine_ids,
    varied_prompt,
)

pytestmark = pytest.mark.engines


def test_tiny_model_greedy_output_is_not_degenerate(local_pair: LocalPair) -> None:
    messages = [{"role": "user", "content": "Write a poem about the sea."}]
    ids = single_engine_ids(local_pair.prefill_url, local_pair.model, messages, max_tokens=32)
    assert len(ids) == 32
    assert len(set(ids)) >= 10, f"only {len(set(ids))} distinct tokens in {ids}"


def test_decode_after_transfer_equals_single_engine(local_pair: LocalPair) -> None:
    # A prompt of its own: nothing of it may sit in decode's prefix cache already.
    messages = [{"role": "user", "content": long_prompt(1500, f"lighthouses {uuid.uuid4()}")}]
    decode_metrics = httpx.get(f"{local_pair.decode_url}/metrics").text
    transfers_before = metric_total(decode_metrics, "vllm:nixl_xfer_time_seconds_count")
    bytes_before = metric_total(decode_metrics, "vllm:nixl_bytes_transferred_sum")

    prefill = chat(
        local_pair.prefill_url,
        {"model": local_pair.model, "messages": messages, "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": dict(PREFILL_PARAMS)},
    )  # fmt: skip
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_num_tokens"] == prefill["usage"]["prompt_tokens"]

    decode = chat(
        local_pair.decode_url,
        {"model": local_pair.model, "messages": messages, "max_tokens": 32, "temperature": 0,
         "return_token_ids": True, "kv_transfer_params": params},
    )  # fmt: skip
    expected = single_engine_ids(local_pair.prefill_url, local_pair.model, messages, 32)
    got = list(decode["choices"][0]["token_ids"])
    pairs = enumerate(zip(got, expected, strict=False))
    first_diff = next((i for i, (a, b) in pairs if a != b), None)
    assert got == expected, f"first divergence at token {first_diff}"

    # Decode pulled the prompt's KV over NIXL rather than computing it.
    deadline = time.monotonic() + 15  # stats reach /metrics on the next logging interval
    while True:
        decode_metrics = httpx.get(f"{local_pair.decode_url}/metrics").text
        transfers = metric_total(decode_metrics, "vllm:nixl_xfer_time_seconds_count")
        moved = metric_total(decode_metrics, "vllm:nixl_bytes_transferred_sum")
        if transfers > transfers_before or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert transfers > transfers_before
    # float32 KV of ~1.5k tokens: 4 layers x K,V x 2 heads x 64 dims x 4 bytes = 4 KiB/token.
    assert moved - bytes_before >= 1400 * 4096


def test_decode_publishes_retained_kv_for_the_gateway(local_pair: LocalPair) -> None:
    messages = [{"role": "user", "content": long_prompt(600, "owls")}]
    prefill = chat(
        local_pair.prefill_url,
        {"model": local_pair.model, "messages": messages, "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": dict(PREFILL_PARAMS)},
    )  # fmt: skip
    request_id = "kvturn-test-publish"
    chat(
        local_pair.decode_url,
        {"model": local_pair.model, "messages": messages, "max_tokens": 8, "temperature": 0,
         "stream": False, "kv_transfer_params": prefill["kv_transfer_params"]},
        headers={"X-Request-Id": request_id},
    )  # fmt: skip
    control = f"{local_pair.decode_control_url}/kvturn"
    # Only the gateway (the holder of the secret) may see or touch what decode retains.
    assert httpx.get(f"{control}/retained/{request_id}").status_code == 401
    published = httpx.get(
        f"{control}/retained/{request_id}", headers=local_pair.control_headers
    ).json()
    assert published["do_remote_decode"] is True
    # Prompt plus the generated tokens that have KV (the last sampled token has none yet).
    assert published["remote_num_tokens"] == prefill["usage"]["prompt_tokens"] + 7
    assert len(published["kvturn_prefix_digests"]) == published["remote_num_tokens"] // 16
    assert 0 < published["expires_in_s"] <= 120
    missing = httpx.get(f"{control}/retained/nope", headers=local_pair.control_headers)
    assert missing.status_code == 404


def _retained_on_decode(pair: LocalPair, messages: list[dict[str, str]]) -> dict[str, object]:
    """One P/D turn straight on the engines; what decode then publishes (as the gateway gets it
    before a pull-reuse turn)."""
    prefill = chat(
        pair.prefill_url,
        {"model": pair.model, "messages": messages, "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": dict(PREFILL_PARAMS)},
    )  # fmt: skip
    request_id = f"kvturn-test-{uuid.uuid4().hex[:8]}"  # ends like a vLLM suffix: found as sent
    chat(
        pair.decode_url,
        {"model": pair.model, "messages": messages, "max_tokens": 8, "temperature": 0,
         "kv_transfer_params": prefill["kv_transfer_params"]},
        headers={"X-Request-Id": request_id},
    )  # fmt: skip
    url = f"{pair.decode_control_url}/kvturn/retained/{request_id}?wait_ms=5000"
    params = httpx.get(url, timeout=30, headers=pair.control_headers).json()
    params.pop("expires_in_s")
    return dict(params)


def _pull(pair: LocalPair, messages: list[dict[str, str]], params: dict[str, object]) -> int:
    """Prefill ``messages`` with a decode's retained params; the tokens it took from them."""
    answer = chat(
        pair.prefill_url,
        {"model": pair.model, "messages": messages, "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": params},
    )  # fmt: skip
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def _prompt_ids(pair: LocalPair, messages: list[dict[str, str]]) -> list[int]:
    body = {"model": pair.model, "messages": messages}
    return list(httpx.post(f"{pair.prefill_url}/tokenize", json=body, timeout=60).json()["tokens"])


def test_prefill_pulls_only_what_the_digests_prove(local_pair: LocalPair) -> None:
    """The connector's guard against vLLM trusting any KV it is pointed at: without digests
    nothing is pulled; with them, only whole blocks of the verified common prefix."""
    topic = f"owls {uuid.uuid4()}"
    held = [{"role": "user", "content": long_prompt(800, topic)}]
    params = _retained_on_decode(local_pair, held)
    # The same history diverging at character 500 (one token per character).
    text = str(held[0]["content"])
    changed = [{"role": "user", "content": text[:500] + "Z" * 50 + text[550:] + " More?"}]
    common = next(
        i for i, (a, b) in enumerate(zip(_prompt_ids(local_pair, held),
                                         _prompt_ids(local_pair, changed), strict=False))
        if a != b
    )  # fmt: skip

    unproven = {k: v for k, v in params.items() if k != "kvturn_prefix_digests"}
    assert _pull(local_pair, changed, unproven) == 0, "pulled KV with nothing to verify it"

    reads = NixlReads(local_pair.prefill_url)
    pulled = _pull(local_pair, changed, params)
    assert 0 < pulled <= common
    assert pulled % 16 == 0 and pulled > common - 32  # whole blocks, up to the divergence
    reads.wait_for(1, min_bytes=pulled * KV_BYTES_PER_TOKEN)


def _answer_after_pull(
    pair: LocalPair, messages: list[dict[str, str]], params: dict[str, object]
) -> tuple[list[int], int]:
    """16 greedy tokens of prefill's answer to ``messages`` on top of the KV it pulls with
    ``params`` (a fresh cache salt: nothing of its own cache), and the tokens it pulled."""
    answer = chat(
        pair.prefill_url,
        {"model": pair.model, "messages": messages, "max_tokens": 16, "temperature": 0,
         "return_token_ids": True, "cache_salt": uuid.uuid4().hex,
         "kv_transfer_params": params},
    )  # fmt: skip
    pulled = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)
    return list(answer["choices"][0]["token_ids"]), pulled


def test_the_answer_tells_right_kv_from_shifted_or_foreign_kv(local_pair: LocalPair) -> None:
    """The oracle every reuse test leans on (greedy ids equal one engine's alone) is only as
    strong as the model's answer is sensitive to the KV under it. Prefill pulls a decode's
    retained KV three ways, the digests always proving the prompt: as published, the same
    blocks read one block out of place (what an off-by-one in block ids would do), and another
    conversation's blocks (a lease mixed up). The tiny random-weight model answers as one engine
    alone only on the right KV: for prompts of seeded random words (no block repeats another)
    and for the repeated sentence most tests use (:func:`long_prompt`)."""
    prompts = [varied_prompt(700, 1), varied_prompt(700, 2), long_prompt(700, "owls")]
    for seed, prompt in enumerate(prompts, start=1):
        messages = [{"role": "user", "content": prompt}]
        want = single_engine_ids(local_pair.prefill_url, local_pair.model, messages, 16)
        right, pulled = _answer_after_pull(
            local_pair, messages, _retained_on_decode(local_pair, messages)
        )
        assert pulled >= 640 and right == want, (seed, pulled)

        shifted = _retained_on_decode(local_pair, messages)
        groups = shifted["remote_block_ids"]
        assert isinstance(groups, list)
        shifted["remote_block_ids"] = [[*g[1:], g[0]] for g in groups]
        got, pulled = _answer_after_pull(local_pair, messages, shifted)
        assert pulled >= 640 and got != want, (seed, "a shifted pull went unnoticed")

        other = [{"role": "user", "content": varied_prompt(700, seed + 100)}]
        foreign = _retained_on_decode(local_pair, messages)
        foreign["remote_block_ids"] = _retained_on_decode(local_pair, other)["remote_block_ids"]
        got, pulled = _answer_after_pull(local_pair, messages, foreign)
        assert pulled >= 640 and got != want, (seed, "another conversation's KV went unnoticed")


def _process_stats() -> Iterator[tuple[str, list[str]]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command) of every process: state is
    field 0, the process group 2, user and system CPU ticks 11 and 12."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                yield entry, stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue


def _group_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by every process in ``pid``'s process group (an engine, its
    engine core and its workers)."""
    group = os.getpgid(pid)
    ticks = sum(int(f[11]) + int(f[12]) for _, f in _process_stats() if int(f[2]) == group)
    return ticks / os.sysconf("SC_CLK_TCK")


def test_an_idle_pair_holding_a_lease_does_not_spin(local_pair: LocalPair) -> None:
    """The connector's CPU fixes: NIXL's progress thread no longer spins a core per agent, and
    decode's engine loop paces its empty steps while it retains a conversation's blocks (upstream,
    each costs about a core; measured here with the fixes: ~0.03 core)."""
    conversation = f"idle-{uuid.uuid4().hex[:8]}"
    body = {"model": local_pair.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": long_prompt(600, conversation)}]}  # fmt: skip
    gateway = local_pair.gateway_url.removesuffix("/v1")
    httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"X-Conversation-Id": conversation},
        timeout=120,
    ).raise_for_status()  # fmt: skip
    retained = httpx.get(
        f"{local_pair.decode_control_url}/kvturn/leases", headers=local_pair.control_headers
    ).json()["leases"]
    assert retained >= 1  # decode retains the conversation's blocks all along
    time.sleep(3)  # past the short pacing window that follows work
    before = {pid: _group_cpu_seconds(pid) for pid in local_pair.engine_pids}
    window_s = 10.0
    time.sleep(window_s)
    for pid, cpu in before.items():
        cores = (_group_cpu_seconds(pid) - cpu) / window_s
        assert cores < 0.3, f"engine {pid} used {cores:.2f} cores while idle"
    httpx.delete(f"{gateway}/v1/kvturn/conversations/{conversation}")


@pytest.mark.stops_engines
def test_sigint_to_kvturn_up_stops_every_engine(local_pair: LocalPair) -> None:
    groups = {os.getpgid(pid) for pid in local_pair.engine_pids}
    assert _live_processes_in(groups), "the engines should be running before the signal"
    assert local_pair.process is not None
    local_pair.process.send_signal(signal.SIGINT)
    assert local_pair.process.wait(timeout=90) == 0
    assert _live_processes_in(groups) == []


def _live_processes_in(groups: set[int]) -> list[str]:
    """Processes of these process groups that are still running (zombies are dead: skipped)."""
    return [
        f"{pid} ({f[0]})"
        for pid, f in _process_stats()
        if int(f[2]) in groups and f[0] not in ("Z", "X")
    ]
