"""What each example agent prints: every model call it made, what kvturn did with it, and the
same call recomputed.

- **Record.** :class:`Recorder` sits under the agent's kvturn client as its httpx transport
  (httpx's public transport API), whatever framework drives the client. For each
  chat-completions request it keeps the exact JSON body the framework sent, the gateway's
  ``X-Kvturn-Plan`` and ``X-Kvturn-Reused-Tokens``, the time to the reply's first byte (TTFT:
  the first streamed chunk leaves decode with the first token) and the reply itself.
- **Replay.** :func:`replay` sends each recorded body again to the same gateway, after the
  agent's run, as the first turn of a new conversation and with a fresh ``cache_salt``, so
  neither kvturn nor any engine's prefix cache helps: the TTFT that call would have had
  recomputed, and the answer recomputing gives. Given the engines, it also replays the whole
  run as "vLLM P/D as deployed" would serve it (:func:`replay_deployed`): every call, in order,
  as a P/D request straight to the engines (prefill, then decode with prefill's
  ``kv_transfer_params``, what vllm-router does with one engine of each), under one fresh
  ``cache_salt`` of its own, so prefill's prefix cache holds what the earlier calls left there
  and nothing of kvturn's run: the baseline a vLLM user already has.
- **Report.** :func:`print_table` prints one row per call; :func:`plot` draws the same as a PNG.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from kvturn.control import release_path
from kvturn.headers import CONVERSATION_ID


def _http_module() -> Any:
    """The HTTP library the installed openai SDK is built on: ``httpx2`` from openai 3 on,
    ``httpx`` before (same API); a transport must be the SDK's library's."""
    try:
        import httpx2

        if issubclass(openai.DefaultHttpxClient, httpx2.Client):
            return httpx2
    except ImportError:
        pass
    import httpx as httpx1

    return httpx1


httpx = _http_module()


@dataclass(frozen=True)
class Answer:
    """A chat completion's reply, put together from its stream (or its body)."""

    text: str
    #: (name, arguments) of each tool call, in order (ids left out: they are random).
    tool_calls: tuple[tuple[str, str], ...]
    prompt_tokens: int | None
    finish_reason: str | None

    def summary(self, width: int = 60) -> str:
        if self.tool_calls:
            shown = ", ".join(f"{name}({args})" for name, args in self.tool_calls)
        else:
            shown = self.text.strip().replace("\n", " ")
        return shown if len(shown) <= width else shown[: width - 1] + "…"


def parse_answer(raw: bytes) -> Answer:
    """The reply in a chat-completions response body: SSE chunks or one JSON object."""
    text, finish, prompt_tokens = "", None, None
    calls: dict[int, list[str]] = {}
    stripped = raw.lstrip()
    if stripped.startswith(b"{"):
        body = json.loads(stripped)
        message = body["choices"][0]["message"]
        for i, call in enumerate(message.get("tool_calls") or []):
            calls[i] = [call["function"]["name"], call["function"]["arguments"]]
        usage = body.get("usage") or {}
        return Answer(
            message.get("content") or "",
            tuple((n, a) for n, a in calls.values()),
            usage.get("prompt_tokens"),
            body["choices"][0].get("finish_reason"),
        )
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"].get("prompt_tokens")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            finish = choice.get("finish_reason") or finish
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call.get("index", 0), ["", ""])
                function = call.get("function") or {}
                entry[0] += function.get("name") or ""
                entry[1] += function.get("arguments") or ""
    return Answer(text, tuple((n, a) for n, a in calls.values()), prompt_tokens, finish)


@dataclass
class Call:
    """One chat-completions request as sent, and its reply (through kvturn or replayed)."""

    body: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    plan: str | None = None
    #: Why the gateway chose ``plan`` (``X-Kvturn-Plan-Reason``).
    plan_reason: str | None = None
    reused_tokens: int = 0
    ttft_s: float | None = None
    raw: bytearray = field(default_factory=bytearray)
    #: Set once the reply has been read to its end.
    answer: Answer | None = None

    def _answered(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.plan = response.headers.get("x-kvturn-plan")
        self.plan_reason = response.headers.get("x-kvturn-plan-reason")
        reused = response.headers.get("x-kvturn-reused-tokens", "0")
        self.reused_tokens = int(reused) if reused.isdigit() else 0

    def _chunk(self, chunk: bytes) -> None:
        if self.ttft_s is None and chunk:
            self.ttft_s = time.perf_counter() - self.started
        self.raw += chunk

    def _closed(self) -> None:
        if self.answer is None and self.status == 200:
            self.answer = parse_answer(bytes(self.raw))


def _is_chat_completion(request: httpx.Request) -> bool:
    return request.method == "POST" and request.url.path.endswith("/chat/completions")


class _SyncTee(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, call: Call) -> None:
        self.inner, self.call = inner, call

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.call._chunk(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()
        self.call._closed()


class _AsyncTee(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, call: Call) -> None:
        self.inner, self.call = inner, call

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.call._chunk(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()
        self.call._closed()


class _SyncTransport(httpx.BaseTransport):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder, self.inner = recorder, httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_chat_completion(request):
            return self.inner.handle_request(request)
        request, call = self.recorder._begin(request)
        response = self.inner.handle_request(request)
        call._answered(response)
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_SyncTee(response.stream, call),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self.inner.close()


class _AsyncTransport(httpx.AsyncBaseTransport):
    def __init__(self, recorder: Recorder) -> None:
        self.recorder, self.inner = recorder, httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_chat_completion(request):
            return await self.inner.handle_async_request(request)
        request, call = self.recorder._begin(request)
        response = await self.inner.handle_async_request(request)
        call._answered(response)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_AsyncTee(response.stream, call),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class Recorder:
    """Every chat-completions call made through the clients built on its transports.

    ``OpenAI(..., http_client=openai.DefaultHttpxClient(transport=recorder.transport()))``
    (``DefaultAsyncHttpxClient`` and :meth:`async_transport` for ``AsyncOpenAI``).

    Given a ``cache_salt``, every chat-completions request goes out with it (whatever the
    framework sent): the demo gives each of its runs a salt of its own, so that no run finds
    an earlier run's prompts in an engine's prefix cache.
    """

    def __init__(self, cache_salt: str | None = None) -> None:
        self.calls: list[Call] = []
        self.cache_salt = cache_salt

    def transport(self) -> httpx.BaseTransport:
        return _SyncTransport(self)

    def async_transport(self) -> httpx.AsyncBaseTransport:
        return _AsyncTransport(self)

    def _begin(self, request: httpx.Request) -> tuple[httpx.Request, Call]:
        """The request to send (salted, given a ``cache_salt``) and its record."""
        body = json.loads(request.content)
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
            content = json.dumps(body).encode()
            headers = httpx.Headers(request.headers)
            headers["content-length"] = str(len(content))
            request = httpx.Request(
                request.method, request.url, headers=headers, content=content,
                extensions=request.extensions,
            )  # fmt: skip
        call = Call(body)
        self.calls.append(call)
        return request, call


#: What prefill gets in plain P/D (vLLM's NixlConnector protocol; as in kvturn.wire).
_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def replay_deployed(
    http: Any, engines: tuple[str, str], body: dict[str, Any], salt: str, api_key: str
) -> Call:
    """``body`` as plain P/D with prefix caching serves it: prefill (one token, its KV kept
    for decode), then decode reading that KV; TTFT from the prefill request on."""
    prefill, decode = (url.rstrip("/") for url in engines)
    headers = {"Authorization": f"Bearer {api_key}"}
    call = Call({**body, "cache_salt": salt})
    dropped = ("stream_options", "max_completion_tokens")
    first = {k: v for k, v in call.body.items() if k not in dropped}
    first.update(stream=False, max_tokens=1, kv_transfer_params=_PREFILL_PARAMS)
    answer = http.post(f"{prefill}/v1/chat/completions", json=first, headers=headers)
    if answer.status_code != 200:
        raise RuntimeError(f"P/D replay: prefill said {answer.status_code}: {answer.text[:300]}")
    second = {**call.body, "kv_transfer_params": answer.json()["kv_transfer_params"]}
    with http.stream("POST", f"{decode}/v1/chat/completions", json=second, headers=headers) as r:
        call._answered(r)
        for chunk in r.iter_raw():
            call._chunk(chunk)
    call._closed()
    if call.answer is None:
        raise RuntimeError(f"P/D replay failed: HTTP {call.status}: {bytes(call.raw)[:300]!r}")
    return call


def replay_one(http: Any, base_url: str, body: dict[str, Any], api_key: str) -> Call:
    """``body`` sent again so that nothing can be reused: recomputed.

    It goes as the first turn of a conversation of its own (a new id: no KV is kept for it,
    and the gateway cannot take it for the next turn of another conversation, as it may a
    request without an id) with a fresh ``cache_salt`` (no prefix cache of any engine matches
    it); the conversation is released at once, so its KV is not kept either.
    """
    conversation_id = f"replay-{uuid.uuid4().hex}"
    call = Call({**body, "cache_salt": f"replay-{uuid.uuid4().hex}"})
    headers = {"Authorization": f"Bearer {api_key}", CONVERSATION_ID: conversation_id}
    base = base_url.rstrip("/")
    with http.stream("POST", f"{base}/chat/completions", json=call.body, headers=headers) as r:
        call._answered(r)
        for chunk in r.iter_raw():
            call._chunk(chunk)
    call._closed()
    http.delete(f"{base}{release_path(conversation_id)}", headers=headers)
    if call.answer is None:
        raise RuntimeError(f"replay failed: HTTP {call.status}: {bytes(call.raw)[:300]!r}")
    return call


@dataclass
class Row:
    """One model call: through kvturn, and the same call recomputed (None if not replayed)."""

    index: int
    kvturn: Call
    recomputed: Call | None
    #: The same call as vLLM P/D with prefix caching served it (None if not replayed).
    deployed: Call | None = None

    @property
    def context_tokens(self) -> int | None:
        for call in (self.kvturn, self.recomputed):
            if call is not None and call.answer is not None and call.answer.prompt_tokens:
                return call.answer.prompt_tokens
        return None

    @property
    def same_answer(self) -> bool | None:
        if self.recomputed is None:
            return None
        return self.kvturn.answer == self.recomputed.answer or (
            # Usage may be missing from one side only; the reply is what must match.
            self.kvturn.answer is not None
            and self.recomputed.answer is not None
            and (self.kvturn.answer.text, self.kvturn.answer.tool_calls)
            == (self.recomputed.answer.text, self.recomputed.answer.tool_calls)
        )


def replay(
    calls: Sequence[Call],
    base_url: str,
    api_key: str = "unused",
    compare: bool = True,
    engines: tuple[str, str] | None = None,
) -> list[Row]:
    """A row per recorded call, each replayed recomputed (``compare``) after the run, and,
    given ``engines`` (prefill URL, decode URL), the whole run replayed as plain P/D with
    prefix caching."""
    rows = []
    salt = f"deployed-{uuid.uuid4().hex}"
    with httpx.Client(timeout=600) as http:
        for i, call in enumerate(calls, 1):
            again = replay_one(http, base_url, call.body, api_key) if compare else None
            rows.append(Row(i, call, again))
        if compare and engines is not None:
            for row in rows:
                row.deployed = replay_deployed(http, engines, row.kvturn.body, salt, api_key)
    return rows


def compact_json(text: str) -> str:
    """``text`` re-serialised without the whitespace a random-weight model pads JSON with."""
    try:
        return json.dumps(json.loads(text), separators=(",", ":"))
    except ValueError:
        return " ".join(text.split())


def step_label(call: Call) -> str:
    """``tool_name first-argument`` for a call that asked for a tool, else ``answer``."""
    answer = call.answer
    if answer is None:
        return f"HTTP {call.status}"
    if not answer.tool_calls:
        return "answer"
    name, arguments = answer.tool_calls[0]
    try:
        values = list(json.loads(arguments or "{}").values())
    except ValueError:
        values = [arguments]
    return " ".join([name, *(str(v) for v in values)])


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def ratio_text(ours: float | None, theirs: float | None) -> str:
    """kvturn's time over a baseline's, said plainly: ``0.84 faster``, ``1.21 slower`` (above
    1.00 kvturn took longer), ``1.00 same``; ``-`` when either is missing."""
    if not ours or not theirs:
        return "-"
    ratio = ours / theirs
    shown = f"{ratio:.2f}"
    if shown == "1.00":
        return "1.00 same"
    return f"{shown} {'slower' if ratio > 1 else 'faster'}"


def print_table(rows: Sequence[Row], labels: Sequence[str] | None = None) -> None:
    """One line per model call: context, plan, reused tokens, TTFT through kvturn, recomputed
    (no prefix cache, nothing kept: P/D with nothing to reuse) and, when replayed, as vLLM P/D
    with prefix caching serves the same run; whether kvturn's answer equals the recomputed."""
    deployed = any(r.deployed for r in rows)
    print(
        f"{'call':>4}  {'step':<22} {'context':>7} {'plan':>12} {'reused':>6} "
        f"{'TTFT kvturn':>11} {'TTFT recompute':>14}"
        + (f" {'TTFT vLLM P/D':>13} {'kvturn over P/D':>15}" if deployed else "")
        + "  same answer"
    )
    for n, row in enumerate(rows):
        label = labels[n] if labels and n < len(labels) else ""
        step = label or step_label(row.kvturn)
        same = {None: "-", True: "yes", False: "NO"}[row.same_answer]
        context = row.context_tokens
        recomputed = row.recomputed.ttft_s if row.recomputed else None
        pd = row.deployed.ttft_s if row.deployed else None
        print(
            f"{row.index:>4}  {step[:22]:<22} {context if context is not None else '-':>7} "
            f"{row.kvturn.plan or '?':>12} {row.kvturn.reused_tokens:>6} "
            f"{_ms(row.kvturn.ttft_s):>11} {_ms(recomputed):>14}"
            + (f" {_ms(pd):>13} {ratio_text(row.kvturn.ttft_s, pd):>15}" if deployed else "")
            + f"  {same}"
        )
    reused = [r for r in rows[1:] if r.recomputed and r.kvturn.ttft_s and r.recomputed.ttft_s]
    if reused:
        ours = sum(r.kvturn.ttft_s or 0 for r in reused)
        theirs = sum(r.recomputed.ttft_s or 0 for r in reused if r.recomputed)
        print(
            f"\ncalls 2..{len(rows)}: TTFT {ours * 1000:.0f} ms with kvturn vs "
            f"{theirs * 1000:.0f} ms recomputed (kvturn over recomputed: "
            f"{ratio_text(ours, theirs)})"
        )
        pds = [r.deployed.ttft_s for r in reused if r.deployed and r.deployed.ttft_s]
        if len(pds) == len(reused):
            total = sum(pds)
            print(
                f"calls 2..{len(rows)}: TTFT {ours * 1000:.0f} ms with kvturn vs "
                f"{total * 1000:.0f} ms as vLLM P/D with prefix caching (kvturn over vLLM P/D: "
                f"{ratio_text(ours, total)})"
            )
        print(
            "recompute: the call alone, no cache (a fresh cache_salt); vLLM P/D: the run's "
            "calls in order, prefill then decode, prefill's prefix cache on (vLLM's default); "
            "a ratio above 1.00 means kvturn was slower. One run, after kvturn's: for a fair "
            "comparison (warm engines, alternating order) run examples/demo.py"
        )


def plot(rows: Sequence[Row], path: Path, title: str) -> Path:
    """A PNG of TTFT per model call, kvturn beside recomputed, plan and reused tokens marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    xs = [r.index for r in rows]
    ours = [(r.kvturn.ttft_s or 0) * 1000 for r in rows]
    theirs = [(r.recomputed.ttft_s or 0) * 1000 if r.recomputed else 0 for r in rows]
    deployed = [(r.deployed.ttft_s or 0) * 1000 if r.deployed else 0 for r in rows]
    series = 3 if any(deployed) else 2
    width = 0.8 / series
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2), dpi=110)
    colours = {"recompute": "#9e9e9e", "pull-reuse": "#1f77b4", "decode-local": "#2ca02c"}
    first = -width * (series - 1) / 2
    bars = ax.bar(
        [x + first for x in xs],
        ours,
        width,
        color=[colours.get(r.kvturn.plan or "", "#ff7f0e") for r in rows],
    )
    ax.bar([x + first + width for x in xs], theirs, width, color="#d62728", alpha=0.55)
    if series == 3:
        ax.bar([x + first + 2 * width for x in xs], deployed, width, color="#9467bd", alpha=0.7)
    plans = list(dict.fromkeys(r.kvturn.plan or "?" for r in rows))
    handles = [Patch(color=colours.get(p, "#ff7f0e"), label=f"kvturn: {p}") for p in plans]
    handles.append(Patch(color="#d62728", alpha=0.55, label="same call recomputed"))
    if series == 3:
        handles.append(
            Patch(color="#9467bd", alpha=0.7, label="vLLM P/D, prefix caching (as deployed)")
        )
    for bar, row in zip(bars, rows, strict=True):
        note = f"{row.kvturn.plan or '?'}\n{row.kvturn.reused_tokens} reused"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r.index}\n{r.context_tokens or '?'} tok" for r in rows], fontsize=8)
    ax.set_xlabel("model call (prompt tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.margins(y=0.18)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
