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
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
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


class CompletionRequest(_Common):
    prompt: (
        StrictStr
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
        | Annotated[list[StrictInt], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[StrictInt], Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_BATCH_PROMPTS),
        ]
    )


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
