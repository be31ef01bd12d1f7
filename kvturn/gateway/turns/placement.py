"""Which prefill engine takes a turn, and where a prompt's tokens are counted."""

from __future__ import annotations

from kvturn.gateway.pools import Instance, Pool
from kvturn.gateway.turns.model import Turn

#: How many requests more than the least loaded prefill a turn's affine prefill may be serving
#: and still get it (:func:`choose_prefill`): a prefix-cache hit saves most of a prefill, a
#: queue of two is a fraction of one.
PREFILL_AFFINITY_SLACK = 2


def choose_prefill(pool: Pool, turn: Turn, exclude: Instance | None = None) -> Instance:
    """The prefill for a turn: the one its conversation's prompts have gone to (so its prefix
    cache may still hold them), unless that one serves more than
    :data:`PREFILL_AFFINITY_SLACK` requests more than the least loaded.

    A chat turn is placed by the digest of its first two messages (the system prompt and the
    first user message, with the tenant, model and cache salt): stable for every turn of a
    conversation, shared by a fork or subagent that starts from the same messages, and spread
    across conversations that share only a system prompt (each prefill then computes that
    prompt once). Other requests by their conversation id, if any."""
    key: bytes | None = None
    if len(pool.instances) > 1:
        digests = turn.message_digests()
        if digests:
            key = digests[min(1, len(digests) - 1)]
        elif turn.conversation_id:
            key = f"{turn.tenant}\0{turn.conversation_id}".encode()
    prefer = pool.affine(key) if key is not None else None
    return pool.choose(prefer, exclude=exclude, slack=PREFILL_AFFINITY_SLACK)


def counter(prefill: Pool, holder: Instance) -> Instance:
    """Where to count a prompt's tokens: an idle prefill engine if there is one (every engine
    renders the same template with the same tokenizer), else the holder. The holder is being
    woken for this very turn (see :meth:`~.runner.TurnRunner.wake_decode`), and on CPU engines
    its API server shares a core with that engine: measured here, ``/tokenize`` of a 2k-token
    chat prompt took 2.8 ms on an idle prefill engine and 4.1 ms on an idle decode."""
    idle = [i for i in prefill.healthy() if i.in_flight == 0]
    return idle[0] if idle else holder
