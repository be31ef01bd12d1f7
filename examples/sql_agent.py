"""A LangGraph SQL agent over a real SQLite database, through kvturn.

    .venv/bin/python examples/sql_agent.py --base-url http://127.0.0.1:8000/v1

At start it builds a fresh SQLite database from the small dataset shipped in
``examples/data/`` (the eight planets and twenty of their moons; see its README), then answers
questions about it with an ordinary LangGraph graph: an agent node on ``ChatOpenAI``, a
``ToolNode``, ``tools_condition``, a checkpointer keeping the thread's messages. Its tools run
real SQL on that database: ``describe_table`` (schema from ``PRAGMA table_info``, row count,
sample rows), ``top_rows`` (``SELECT * … ORDER BY … LIMIT``) and ``aggregate`` (``SELECT
group, fn(column) … GROUP BY``); each returns the SQL it ran and SQLite's rows (or SQLite's
error). The only kvturn parts: ``ChatOpenAI`` comes from ``kvturn.client.adapters.langchain
.chat_openai`` on a ``kvturn.client.OpenAI``, whose calls belong to the kvturn conversation
named by the LangGraph ``thread_id``; ``release_thread`` ends it.

Honest constraints, for a 135M-parameter model (the demo's SmolLM2) or the tests' random-weight
model, neither of which writes SQL or drives a tool loop on its own:

- the query tools take enum arguments (table, column, function, order, limit; strict schemas,
  so vLLM pins the call's arguments to them) and compose the SQL themselves: a free-form
  ``query: str`` tool is the natural design for a capable model, but a small one writes
  invalid SQL, and a random-weight model's free string runs on to ``max_tokens``;
- each question names its tool in ``tool_choice`` while the last message is the user's; after
  the tool's result the answering call keeps the tools offered with ``tool_choice="none"``
  (the same tools on every call keep the prompt's prefix, and so its KV, the same).

Prints one row per model call: plan, reused tokens, TTFT through kvturn beside the same call
recomputed (replayed as a new conversation with a fresh ``cache_salt``), and whether both
answers are the same.
"""

from __future__ import annotations

import argparse
import csv
import sqlite3
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import openai
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

sys.path.insert(0, str(Path(__file__).parent))
import turn_report

from kvturn.client import OpenAI
from kvturn.client.adapters.langchain import chat_openai, release_thread

DATA = Path(__file__).parent / "data"
SYSTEM = (
    "You answer questions about a SQLite database of the solar system's planets and moons. "
    "Use the tools to query it, then answer in one sentence with the numbers you found."
)
#: (question, the tool it names in tool_choice).
QUESTIONS: tuple[tuple[str, str], ...] = (
    ("What is in the planets table?", "describe_table"),
    ("Which planet has the most moons?", "top_rows"),
    ("What is the largest moon diameter of each planet?", "aggregate"),
)

Table = Literal["planets", "moons"]
Column = Literal[
    "name", "kind", "planet", "mass_1e24_kg", "diameter_km", "distance_from_sun_1e6_km",
    "orbital_period_days", "moons",
]  # fmt: skip


def build_database(path: str = ":memory:") -> sqlite3.Connection:
    """A fresh database with one table per CSV file in ``examples/data`` (types inferred)."""
    db = sqlite3.connect(path, check_same_thread=False)
    for source in sorted(DATA.glob("*.csv")):
        with source.open(newline="") as f:
            rows = list(csv.reader(f))
        header, body = rows[0], rows[1:]

        def kind(i: int, body: list[list[str]] = body) -> str:
            values = [r[i] for r in body]
            for name, parse in (("INTEGER", int), ("REAL", float)):
                try:
                    [parse(v) for v in values]
                    return name
                except ValueError:
                    continue
            return "TEXT"

        columns = ", ".join(f"{name} {kind(i)}" for i, name in enumerate(header))
        db.execute(f"CREATE TABLE {source.stem} ({columns})")
        marks = ", ".join("?" * len(header))
        db.executemany(f"INSERT INTO {source.stem} VALUES ({marks})", body)
    db.commit()
    return db


def _rows(db: sqlite3.Connection, sql: str) -> str:
    try:
        cursor = db.execute(sql)
    except sqlite3.Error as error:
        return f"{sql}\nSQLite error: {error}"
    names = [d[0] for d in cursor.description]
    lines = [" | ".join(names)] + [" | ".join(str(v) for v in row) for row in cursor.fetchall()]
    return f"{sql}\n" + "\n".join(lines[:21])


def make_tools(db: sqlite3.Connection) -> list[Any]:
    @tool
    def describe_table(table: Table) -> str:
        """The table's columns and types, its row count and its first three rows."""
        columns = db.execute(f"PRAGMA table_info({table})").fetchall()
        count = db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        schema = ", ".join(f"{c[1]} {c[2]}" for c in columns)
        return f"{table}({schema}): {count} rows\n" + _rows(db, f"SELECT * FROM {table} LIMIT 3")

    @tool
    def top_rows(table: Table, order_by: Column, limit: Literal[1, 3, 5]) -> str:
        """The rows of a table with the highest values of a column, highest first."""
        return _rows(db, f"SELECT * FROM {table} ORDER BY {order_by} DESC LIMIT {int(limit)}")

    @tool
    def aggregate(
        table: Table,
        function: Literal["count", "min", "max", "avg", "sum"],
        column: Column,
        group_by: Literal["kind", "planet", "none"],
    ) -> str:
        """An aggregate of a column, for the whole table or per group."""
        if group_by == "none":
            return _rows(db, f"SELECT {function}({column}) FROM {table}")
        return _rows(
            db,
            f"SELECT {group_by}, {function}({column}) FROM {table} "
            f"GROUP BY {group_by} ORDER BY 2 DESC",
        )

    return [describe_table, top_rows, aggregate]


def build_graph(llm: Any, tools: list[Any], answer_max_tokens: int | None = None) -> Any:
    """agent ⇄ tools, the agent's tool named per question (``configurable.tool``)."""
    forced = {t.name: llm.bind_tools(tools, tool_choice=t.name, strict=True) for t in tools}
    extra = {"max_tokens": answer_max_tokens} if answer_max_tokens else {}
    answer = llm.bind_tools(tools, tool_choice="none", strict=True, **extra)

    def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        last = state["messages"][-1]
        model = answer if isinstance(last, ToolMessage) else forced[config["configurable"]["tool"]]
        return {"messages": [model.invoke(state["messages"], config)]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=InMemorySaver())


@dataclass
class Outcome:
    calls: list[turn_report.Call]
    answers: list[str]
    #: Each tool result the graph produced: (tool name, its output).
    tools_ran: list[tuple[str, str]]


def run_agent(
    base_url: str,
    model: str,
    questions: tuple[tuple[str, str], ...] = QUESTIONS,
    max_tokens: int = 128,
    answer_max_tokens: int = 160,
    api_key: str = "unused",
    recorder: turn_report.Recorder | None = None,
) -> Outcome:
    """Ask ``questions`` in one LangGraph thread through kvturn; every model call recorded
    (by ``recorder``, a new one if none is given)."""
    recorder = recorder or turn_report.Recorder()
    client = OpenAI(
        base_url=base_url, api_key=api_key, max_retries=1, timeout=600,
        http_client=openai.DefaultHttpxClient(transport=recorder.transport()),
    )  # fmt: skip
    llm = chat_openai(
        client, model=model, temperature=0, max_tokens=max_tokens, streaming=True,
        stream_usage=True,
    )  # fmt: skip
    db = build_database()
    graph = build_graph(llm, make_tools(db), answer_max_tokens)
    thread = f"sql-agent-{uuid.uuid4().hex[:12]}"
    answers, tools_ran = [], []
    try:
        for i, (question, tool_name) in enumerate(questions):
            config: RunnableConfig = {"configurable": {"thread_id": thread, "tool": tool_name}}
            messages: list[Any] = [("user", question)]
            if i == 0:
                messages.insert(0, ("system", SYSTEM))
            state = graph.invoke({"messages": messages}, config)
            answers.append(str(state["messages"][-1].content))
        for message in state["messages"]:
            if isinstance(message, ToolMessage):
                tools_ran.append((str(message.name), str(message.content)))
    finally:
        release_thread(llm, thread)
        client.close()
        db.close()
    return Outcome(recorder.calls, answers, tools_ran)


def describe(outcome: Outcome) -> None:
    """The questions, the answers, and what each tool returned."""
    for (question, _), answer in zip(QUESTIONS, outcome.answers, strict=False):
        print(f"Q: {question}\nA: {answer.strip()[:300]}\n")
    for name, result in outcome.tools_ran:
        print(f"tool {name}: {result.splitlines()[0][:100] if result else ''}")


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
        print(f"\nwrote {turn_report.plot(rows, png, 'LangGraph SQL agent: TTFT per model call')}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--max-tokens", type=int, default=128, help="for a forced tool call")
    parser.add_argument("--answer-max-tokens", type=int, default=160)
    parser.add_argument("--no-compare", action="store_true", help="skip the recompute replays")
    parser.add_argument("--png", type=Path, default=None, help="also draw the table as a PNG")
    args = parser.parse_args()
    model = (
        args.model or openai.OpenAI(base_url=args.base_url, api_key="-").models.list().data[0].id
    )
    outcome = run_agent(
        args.base_url, model, max_tokens=args.max_tokens, answer_max_tokens=args.answer_max_tokens
    )
    report(outcome, args.base_url, compare=not args.no_compare, png=args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
