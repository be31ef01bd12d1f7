"""An OpenAI Agents SDK agent that answers questions about a local code tree, through kvturn.

    .venv/bin/python examples/code_agent.py --base-url http://127.0.0.1:8000/v1 [--root DIR]

An ordinary Agents SDK agent (``Agent``, function tools, ``SQLiteSession``, ``Runner``): the
only kvturn parts are the client (``kvturn.client.AsyncOpenAI`` instead of
``openai.AsyncOpenAI``) and the adapter's run helpers (``conversation_for_run`` names the
kvturn conversation after the session; ``KvturnRunHooks`` marks tool pauses). Its tools do real
work on the tree given with ``--root`` (default: this repository): list a folder's files (with
line counts), grep the text files for a pattern, read a file's first lines. Each question is
one ``Runner.run_streamed`` of the same session; the session's history grows with every tool
result, and from the second model call on kvturn serves it from the KV that decode kept.

Honest constraints, for a 135M-parameter model (the demo's SmolLM2) or the tests' random-weight
model, neither of which drives a tool loop on its own:

- each question names the tool it needs in ``tool_choice`` (vLLM then constrains the reply to a
  call of that tool); after the tool ran, the answering call keeps the tools offered but with
  ``tool_choice="none"`` (:class:`ToolThenAnswer`), so the model answers instead of looping
  (and the prompt prefix, so its KV, stays the same);
- the tools' arguments are enums (folders, files and patterns found in the tree; strict
  schemas, so vLLM pins the call's arguments to them): a small model picks one, it does not
  have to spell a path.

Prints one row per model call: plan, reused tokens, TTFT through kvturn beside the same call
recomputed (replayed as a new conversation with a fresh ``cache_salt``), and whether both
answers are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    SQLiteSession,
    set_tracing_disabled,
)
from agents.tool import FunctionTool

sys.path.insert(0, str(Path(__file__).parent))
import turn_report

from kvturn.client import AsyncOpenAI
from kvturn.client.adapters.openai_agents import KvturnRunHooks, conversation_for_run

REPO = Path(__file__).resolve().parents[1]
INSTRUCTIONS = (
    "You answer questions about a code repository. Use the tools to look at the code. Once a "
    "tool has answered, reply in one or two plain English sentences (no tool call, no JSON), "
    "naming the files you looked at."
)
#: (question, the tool it names in tool_choice).
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("Which files are in the client folder?", "list_files"),
    ("Where is the X-Conversation-Id header name defined?", "grep_code"),
    ("Read kvturn/headers.py: which headers does a turn carry?", "read_file"),
)
#: What grep_code may search for (an enum: see the module docstring).
PATTERNS = ("X-Conversation-Id", "class .*Client", "def release", "lease", "heartbeat", "TODO")
_SKIP = {".git", ".venv", "__pycache__", "node_modules", "build", "dist"}
_TEXT = {".py", ".md", ".toml", ".txt", ".sh", ".json", ".jinja", ".cfg", ".yml", ".yaml"}
MAX_LINES = 30
MAX_CHARS = 1600


def _skipped(path: Path) -> bool:
    return any(part in _SKIP or part.startswith(".") or part.endswith(".egg-info")
               for part in path.parts)  # fmt: skip


class CodeTree:
    """The tree the tools work on, and the enums their schemas offer."""

    def __init__(self, root: Path, max_files: int = 48) -> None:
        self.root = root.resolve()
        files = sorted(p.relative_to(self.root) for p in self.text_files())
        self.files = [str(p) for p in files if len(p.parts) <= 2][:max_files]
        folders = (p.name for p in self.root.iterdir() if p.is_dir())
        self.folders = [".", *sorted(f for f in folders if not _skipped(Path(f)))]

    def text_files(self) -> Iterator[Path]:
        """The tree's text files, never descending into a skipped folder (a virtual
        environment alone holds tens of thousands of files)."""
        for folder, subfolders, names in os.walk(self.root):
            subfolders[:] = [d for d in subfolders if not _skipped(Path(d))]
            for name in names:
                path = Path(folder, name)
                if path.suffix in _TEXT and not _skipped(Path(name)):
                    yield path

    def list_files(self, folder: str) -> str:
        base = (self.root / folder).resolve()
        if not base.is_relative_to(self.root) or not base.is_dir():
            return f"no folder {folder!r}"
        lines = []
        for p in sorted(base.iterdir()):
            if _skipped(Path(p.name)):
                continue
            if p.is_dir():
                lines.append(f"{p.relative_to(self.root)}/")
            elif p.suffix in _TEXT:
                count = sum(1 for _ in p.open(errors="replace"))
                lines.append(f"{p.relative_to(self.root)}  ({count} lines)")
        return "\n".join(lines[:40]) or "(empty)"

    def grep_code(self, pattern: str) -> str:
        regex = re.compile(pattern)
        hits = []
        for p in sorted(self.text_files()):
            rel = p.relative_to(self.root)
            for n, line in enumerate(p.open(errors="replace"), 1):
                if regex.search(line):
                    hits.append(f"{rel}:{n}: {line.strip()[:100]}")
                    if len(hits) >= 15:
                        return "\n".join(hits) + "\n(more matches not shown)"
        return "\n".join(hits) or f"no match for {pattern!r}"

    def read_file(self, path: str) -> str:
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root) or not target.is_file():
            return f"no file {path!r}"
        lines = target.read_text(errors="replace").splitlines()
        head = "\n".join(lines[:MAX_LINES])[:MAX_CHARS]
        return f"{path} ({len(lines)} lines), first lines:\n{head}"

    def tools(self) -> list[FunctionTool]:
        def tool(name: str, description: str, arg: str, values: list[str], run: Any) -> Any:
            async def invoke(_context: Any, arguments: str) -> str:
                try:
                    value = json.loads(arguments)[arg]
                except (ValueError, KeyError, TypeError) as error:
                    # A reply cut off by max_tokens: the model hears why, as from any tool.
                    return f"invalid arguments {arguments[:80]!r}: {error}"
                # Off the event loop: the client's heartbeats run on it, and a tool that
                # blocked it past the lease would cost the conversation its KV.
                return str(await asyncio.to_thread(run, value))

            schema = {
                "type": "object",
                "properties": {arg: {"type": "string", "enum": values}},
                "required": [arg],
                "additionalProperties": False,
            }
            return FunctionTool(name, description, schema, invoke, strict_json_schema=True)

        return [
            tool("list_files", "List a folder's files with line counts.", "folder",
                 self.folders, self.list_files),
            tool("grep_code", "Search the code for a regular expression.", "pattern",
                 list(PATTERNS), self.grep_code),
            tool("read_file", "Read the first lines of a file.", "path", self.files,
                 self.read_file),
        ]  # fmt: skip


class ToolThenAnswer(OpenAIChatCompletionsModel):
    """Chat completions model whose calls after a forced tool call answer in prose.

    The SDK drops ``tool_choice`` once the forced tool ran (``reset_tool_choice``), leaving
    the model free to call tools again; a small model then loops until ``max_turns``. Here an
    unset ``tool_choice`` with tools offered becomes ``"none"`` (and the answer gets its own
    ``max_tokens``: a forced call's JSON may need more room than a short answer).
    """

    def __init__(self, *args: Any, answer_max_tokens: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer_max_tokens = answer_max_tokens

    def _settled(self, settings: ModelSettings, tools: list[Any]) -> ModelSettings:
        if tools and settings.tool_choice is None:
            return dataclasses.replace(
                settings, tool_choice="none",
                max_tokens=self.answer_max_tokens or settings.max_tokens,
            )  # fmt: skip
        return settings

    async def get_response(  # type: ignore[override]
        self, system_instructions: Any, input: Any, model_settings: ModelSettings,
        tools: list[Any], *args: Any, **kwargs: Any,
    ) -> Any:  # fmt: skip
        return await super().get_response(
            system_instructions, input, self._settled(model_settings, tools), tools,
            *args, **kwargs,
        )  # fmt: skip

    def stream_response(  # type: ignore[override]
        self, system_instructions: Any, input: Any, model_settings: ModelSettings,
        tools: list[Any], *args: Any, **kwargs: Any,
    ) -> AsyncIterator[Any]:  # fmt: skip
        return super().stream_response(
            system_instructions, input, self._settled(model_settings, tools), tools,
            *args, **kwargs,
        )  # fmt: skip


@dataclasses.dataclass
class Outcome:
    calls: list[turn_report.Call]
    answers: list[str]
    #: The tool calls the runs made, as (name, arguments, output).
    tools_ran: list[tuple[str, str, str]]


async def run_agent(
    base_url: str,
    model: str,
    root: Path = REPO,
    questions: tuple[tuple[str, str], ...] = QUESTIONS,
    max_tokens: int = 128,
    answer_max_tokens: int = 160,
    api_key: str = "unused",
    recorder: turn_report.Recorder | None = None,
) -> Outcome:
    """Ask ``questions`` in one session through kvturn; every model call is recorded (by
    ``recorder``, a new one if none is given)."""
    set_tracing_disabled(True)  # nothing leaves this machine
    recorder = recorder or turn_report.Recorder()
    client = AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=1, timeout=600,
        http_client=openai.DefaultAsyncHttpxClient(transport=recorder.async_transport()),
    )  # fmt: skip
    tree = CodeTree(root)
    tools_ran: list[tuple[str, str, str]] = []

    class Hooks(KvturnRunHooks):
        async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
            arguments = getattr(context, "tool_arguments", "")
            tools_ran.append((tool.name, turn_report.compact_json(arguments), str(result)))
            await super().on_tool_end(context, agent, tool, result)

    agent = Agent(
        name="code-guide",
        instructions=INSTRUCTIONS,
        tools=list(tree.tools()),
        model=ToolThenAnswer(
            model=model, openai_client=client, answer_max_tokens=answer_max_tokens
        ),
        model_settings=ModelSettings(temperature=0.0, max_tokens=max_tokens, include_usage=True),
    )
    session = SQLiteSession(f"code-agent-{uuid.uuid4().hex[:12]}")
    answers = []
    try:
        async with conversation_for_run(client, session=session, release=True):
            for question, tool_name in questions:
                forced = agent.clone(
                    model_settings=dataclasses.replace(agent.model_settings, tool_choice=tool_name)
                )
                streamed = Runner.run_streamed(
                    forced, question, session=session, hooks=Hooks(), max_turns=3
                )
                async for _ in streamed.stream_events():
                    pass
                answers.append(str(streamed.final_output))
    finally:
        await client.close()
    return Outcome(recorder.calls, answers, tools_ran)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--root", type=Path, default=REPO, help="the code tree to ask about")
    parser.add_argument("--max-tokens", type=int, default=128, help="for a forced tool call")
    parser.add_argument("--answer-max-tokens", type=int, default=160)
    parser.add_argument("--no-compare", action="store_true", help="skip the recompute replays")
    parser.add_argument("--png", type=Path, default=None, help="also draw the table as a PNG")
    args = parser.parse_args()
    model = (
        args.model or openai.OpenAI(base_url=args.base_url, api_key="-").models.list().data[0].id
    )
    outcome = asyncio.run(
        run_agent(
            args.base_url, model, args.root, max_tokens=args.max_tokens,
            answer_max_tokens=args.answer_max_tokens,
        )
    )  # fmt: skip
    report(outcome, args.base_url, compare=not args.no_compare, png=args.png)
    return 0


def describe(outcome: Outcome) -> None:
    """The questions, the answers, and what each tool returned."""
    for (question, _), answer in zip(QUESTIONS, outcome.answers, strict=False):
        print(f"Q: {question}\nA: {answer.strip()[:300]}\n")
    for name, arguments, result in outcome.tools_ran:
        print(f"tool {name}({arguments}) -> {result.splitlines()[0][:90] if result else ''}")


def report(
    outcome: Outcome,
    base_url: str,
    compare: bool,
    png: Path | None,
    engines: tuple[str, str] | None = None,
) -> list[Any]:
    """Replay the run's calls (recomputed; and as vLLM P/D with prefix caching, given the
    ``engines``: prefill URL, decode URL), print the table, draw it to ``png``."""
    rows = turn_report.replay(outcome.calls, base_url, compare=compare, engines=engines)
    describe(outcome)
    print()
    turn_report.print_table(rows)
    if png is not None:
        print(
            f"\nwrote {turn_report.plot(rows, png, 'Agents SDK code agent: TTFT per model call')}"
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
