"""Requests checked at the edge: the fields the gateway reads or changes, nothing else.

The gateway reads ``stream``, ``n``, the token limits, the messages or prompt, the tools and
the stream options to plan and split a turn; a wrong type there used to reach the engines as
it came (``stream: "false"`` streamed). Each is checked here and a wrong one is answered with
an OpenAI-shaped 400 naming the field; every other field passes through untouched, for the
engine to judge.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
)

from kvturn.gateway.errors import InvalidRequest

#: Token counts past this are no request anyone means (and overflow C integers in engines).
_MAX_TOKENS = 2**31 - 1
#: Choices per request; vLLM has no limit of its own, a gateway needs one.
MAX_N = 128
#: Prompts in one completion request: each is an engine request of its own (a prefill and a
#: decode, :mod:`.batches`); 2,000 at once once exhausted the gateway's descriptors and
#: starved every other caller (issue #39, case 2).
MAX_BATCH_PROMPTS = 256

#: The parts of a pydantic error location that name a union member, not a field or index.
_TYPE_TAG = re.compile(r"^(str|int|bool|float|dict|list|literal)$|[\[\](),']")

_Tokens = Annotated[StrictInt, Field(ge=1, le=_MAX_TOKENS)]
_Object = dict[StrictStr, Any]


def _objects_with(key: str) -> Any:
    """A list of JSON objects each with a string ``key``, checked in place: a long history is
    not copied into models (that cost about 1 ms a turn at 200 messages; this, 0.06 ms)."""

    def check(items: list[Any]) -> list[Any]:
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get(key), str):
                raise ValueError(f"item {i} must be an object with a string '{key}'")
        return items

    return AfterValidator(check)


class _Common(BaseModel):
    # Only the declared fields are looked at; the body itself is passed on as it came.
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: _Object | None = None
    max_tokens: _Tokens | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None


class ChatRequest(_Common):
    messages: Annotated[list[Any], Field(min_length=1), _objects_with("role")]
    max_completion_tokens: _Tokens | None = None
    tools: Annotated[list[Any], _objects_with("type")] | None = None
    tool_choice: Literal["none", "auto", "required"] | _Object | None = None


def _prompt_form(prompt: Any) -> str | None:
    """Which of the four forms of prompt ``prompt`` takes (named as pydantic names union
    members, which errors' locations leave out), from its type and its first item, so that
    that form alone judges it, and stops at its first wrong item (``fail_fast``).
    Judged by every form at once, a list was checked and reported item by item four times,
    on the gateway's loop: a batch of 2,000 one-word prompts took 1.4 ms to refuse (2,003
    errors; four callers refusing in a loop halved another tenant's turns, issue #39 case 2),
    200,000 took 0.41 s, 2,000,000 (a 20 MiB body, under the 32 MiB limit) 7.7 s, the whole
    gateway stopped meanwhile; now 0.01-2 ms, and the error names the limit."""
    if isinstance(prompt, str):
        return "str"
    if not isinstance(prompt, list):
        return None
    first = prompt[0] if prompt else ""
    if isinstance(first, list):
        return "list[list[int]]"
    return "list[str]" if isinstance(first, str) else "list[int]"


class CompletionRequest(_Common):
    prompt: Annotated[
        Annotated[StrictStr, Tag("str")]
        | Annotated[
            list[StrictStr],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS, fail_fast=True),
            Tag("list[str]"),
        ]
        | Annotated[list[StrictInt], Field(min_length=1, fail_fast=True), Tag("list[int]")]
        | Annotated[
            list[Annotated[list[StrictInt], Field(min_length=1, fail_fast=True)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS, fail_fast=True),
            Tag("list[list[int]]"),
        ],
        Discriminator(
            _prompt_form,
            custom_error_type="prompt_type",
            custom_error_message="Input should be a string, a list of strings, a list of "
            "token ids or a list of lists of token ids",
        ),
    ]


_SHAPES: dict[str, type[_Common]] = {
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
}


def check_request(path: str, body: dict[str, Any]) -> None:
    """Raise :class:`InvalidRequest` for the first field the gateway cannot serve as given."""
    try:
        _SHAPES[path].model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"] if not _TYPE_TAG.search(str(part)))
        where = where or "body"
        raise InvalidRequest(f"Invalid '{where}': {first['msg']}.", param=where) from None
    try:
        # The body goes to the engines re-serialised: nesting past what the serialiser takes
        # (orjson: 254 levels) is refused here, not found half-way through a turn.
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise InvalidRequest("request body is nested too deeply") from None
