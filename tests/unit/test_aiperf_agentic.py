"""benchmarks/aiperf_agentic.py and its decode-affinity baseline (benchmarks/affinity_router.py),
without engines or AIPerf: the router's prefix-cache index and the report's ratios."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import affinity_router
import aiperf_agentic
import bidirectional_proxy


def test_the_affinity_index_counts_leading_blocks_it_was_sent() -> None:
    index = affinity_router.BlockIndex(capacity=4, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    hashes = index.hashes(prompt)
    assert len(hashes) == 3  # whole blocks only: the last token is a partial block
    assert index.cached_tokens(hashes) == 0
    index.record(hashes)
    assert index.cached_tokens(hashes) == 6
    # The next turn extends the prompt: its leading blocks are cached, the rest is not.
    longer = index.hashes([*prompt, 8, 9, 10])
    assert index.cached_tokens(longer) == 6
    # Blocks are chained: the same tokens after a different start are not a hit.
    assert index.cached_tokens(index.hashes([9, 9, 3, 4, 5, 6])) == 0


def test_the_affinity_index_forgets_the_least_recently_sent_past_its_capacity() -> None:
    index = affinity_router.BlockIndex(capacity=3, block_size=1)
    first, second = index.hashes([1, 2]), index.hashes([7, 8])
    index.record(first)
    index.record(second)  # four blocks sent into three: the oldest, first's [1], is gone
    assert index.cached_tokens(second) == 2
    assert index.cached_tokens(first) == 0


def test_both_baseline_routers_send_prefill_vllms_own_pd_request() -> None:
    assert bidirectional_proxy.PD_PREFILL_PARAMS is affinity_router.PD_PREFILL_PARAMS
    assert affinity_router.PD_PREFILL_PARAMS["do_remote_decode"] is True


def test_a_session_stays_on_its_engine_and_sessions_spread() -> None:
    urls = ["http://d0", "http://d1", "http://d2"]
    placed = affinity_router.AffinityRouter.placed
    assert all(placed(urls, "s1") == placed(urls, "s1") for _ in range(3))
    assert len({placed(urls, f"s{i}") for i in range(60)}) == 3


def test_a_ratio_is_bold_only_where_its_whole_range_is_below_one() -> None:
    assert aiperf_agentic.ratio([5.0, 6.0], [10.0, 12.0]) == "**0.50 (0.42-0.60)**"
    # A range that holds 1.00 is a tie, never bold.
    assert aiperf_agentic.ratio([9.0, 11.0], [10.0]) == "1.00 (0.90-1.10)"
    assert aiperf_agentic.ratio([], [1.0]) == "-"


def test_the_report_compares_kvturn_with_each_baseline_and_the_best_per_metric() -> None:
    def run(mode: str, ttft: float, itl: float) -> dict[str, object]:
        return {
            "mode": mode, "ttft_p50": ttft, "ttft_p90": ttft, "itl_p50": itl, "itl_p99": itl,
            "latency_p50": 1.0, "latency_p90": 1.0, "job_s": 10.0, "errors": 0.0,
            "tokens": {"computed": 1.0, "cached": 1.0, "received": 1.0},
            "reasons": {"pull-reuse/streams-budget": 3.0},
            "pauses": {"longest_s": 4.0, "total_s": 6.0},
            "command": "aiperf profile",
        }  # fmt: skip

    runs = [run("vllm-pd", 200, 10), run("decode-affinity", 100, 30), run("kvturn", 80, 10)]
    result = {
        "workload": {"name": "w", "what": "a test", "sessions": 2, "concurrency": 1,
                     "kv_blocks": 8},
        "routers": {"vllm-pd": "vllm-router"}, "runs": runs, "answers": None,
        "dataset_lines": 3,
    }  # fmt: skip
    text = aiperf_agentic.report([result], ["--repeats", "1"], "today")
    best = next(line for line in text.splitlines() if line.startswith("| the best baseline"))
    # TTFT against decode-affinity's (the lower), ITL against vllm-pd's: a tie there.
    assert "**0.80 (0.80-0.80)** vs decode-affinity" in best
    assert "1.00 (1.00-1.00) vs vllm-pd" in best
    assert "pull-reuse/streams-budget 3" in text
    # An alternative kvturn mode gets its own ratios, and decode's prompt work is shown.
    alternative = {**run("kvturn-pull-only", 120, 10), "decode_prompt_tokens": 0.0}
    runs.append(alternative)
    runs[-2]["decode_prompt_tokens"] = 4000.0
    text = aiperf_agentic.report([result], ["--repeats", "1"], "today")
    assert "| kvturn-pull-only over |" in text
    assert "kvturn 4000, kvturn-pull-only 0." in text


def test_the_compute_floor_counts_every_new_input_once_and_shared_blocks_once(
    tmp_path: Path,
) -> None:
    import json

    block = aiperf_agentic.BLOCK_SIZE
    rows = [
        # Two sessions open on the same two blocks (a shared prefix), then one of their own.
        {"session_id": "a", "input_length": 3 * block, "hash_ids": [0, 1, 10], "timestamp": 0},
        {"session_id": "b", "input_length": 3 * block, "hash_ids": [0, 1, 20], "timestamp": 0},
        # A later turn: its new input only (the history is the client's to resend).
        {"session_id": "a", "input_length": 50, "hash_ids": [11], "delay": 5},
    ]
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert aiperf_agentic.compute_floor(dataset) == 4 * block + 50


async def test_a_baseline_router_relays_decodes_stream_then_runs_what_follows() -> None:
    import httpx

    events = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]

    async def chunks() -> AsyncIterator[bytes]:
        for event in events:
            yield event

    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200, content=chunks(), headers={"content-type": "text/event-stream"}
        )
    )
    ran: list[str] = []

    async def after() -> None:
        ran.append("after")

    async with httpx.AsyncClient(transport=transport) as client:
        upstream = await client.send(client.build_request("POST", "http://d/v1"), stream=True)
        response = affinity_router.streamed(upstream, after)
        assert (response.status_code, response.media_type) == (200, "text/event-stream")
        relayed = [chunk async for chunk in response.body_iterator]
    assert b"".join(relayed) == b"".join(events)
    assert upstream.is_closed and ran == ["after"]


def test_the_report_gives_each_kvturn_modes_mean_first_token_by_plan() -> None:
    """From the gateway's own ``kvturn_ttft_seconds`` (sum and count by plan, a run's change),
    over every run of the mode; a baseline (no gateway of its own) and older runs say none."""
    by_mode = {
        "kvturn": [
            {"ttft_by_plan": {"decode-local": [3.0, 10.0], "pull-reuse": [2.0, 2.0]}},
            {"ttft_by_plan": {"decode-local": [1.0, 10.0], "pull-reuse": [0.0, 0.0]}},
        ],
        "vllm-pd": [{"ttft_by_plan": None}],
        "kvturn-no-priority": [{}],
    }
    assert aiperf_agentic.first_token_lines(by_mode) == [
        "kvturn's first token by plan (mean; the gateway's `kvturn_ttft_seconds`): "
        "decode-local 200 ms (10 a run), pull-reuse 1000 ms (1 a run)."
    ]
