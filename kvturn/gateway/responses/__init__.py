"""The Responses API (``/v1/responses``) on the chat-turn path.

A Responses request is translated into the chat request it amounts to and served as a chat
turn, through the same planner, plans, fallbacks, leases, headers and metrics; its reply (or
stream) is translated back into a Response object (or Responses SSE events). Nothing about KV
reuse is Responses-specific: the chat template renders the same history into the same tokens
whichever API carried it, so a conversation can even move between the two.

Why not hand ``/v1/responses`` to the engines (vLLM 0.32 serves it): vLLM keeps
``previous_response_id`` state in the memory of the one engine that produced the response, a
decode that the next turn's prefill cannot see; and each engine would need the whole history
anyway. Here the gateway keeps what a chained turn needs (its chat messages, the Response
object and the conversation it belongs to) in a :class:`ResponseStore`, bounded and expiring,
per tenant.

Input items become chat messages as vLLM's own Responses server builds them
(``vllm/entrypoints/openai/responses/utils.py``, ``construct_input_messages``): instructions
first as a system message (never carried to the next turn), message items as messages,
``function_call`` items as tool calls of an assistant message (merged into the one before when
it is the assistant's), ``function_call_output`` items as tool messages. Unlike vLLM, the
previous response's function calls are kept when a turn is chained (vLLM keeps only its text,
so a chained tool turn loses the call its output answers). Reasoning items are left out (no
model kvturn serves emits them); other item types (``item_reference``, hosted tools) get a 400.

The modules: :mod:`.translate` (a request as its chat request), :mod:`.objects` (Response
objects), :mod:`.stream` (a chat stream as Responses events), :mod:`.reply` (a chat turn's reply
answered the Responses way, and stored).
"""
