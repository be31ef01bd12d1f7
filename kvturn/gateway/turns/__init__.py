"""One turn through prefill and decode, told by collaborators with one job each.

:mod:`.runner` (:class:`~.runner.TurnRunner`) keeps the order a turn is served in and its
fallbacks; it asks

- :mod:`.reuse`: which conversation the turn continues (by id, or found by its messages), what
  the table gives it, and how it uses the conversation's previous KV (decode-local, pull-reuse
  or recompute; a lease claimed for a pull);
- :mod:`.sharing`: KV another turn owns that the turn's prompt starts with (a fork's or
  subagent's parent, a parallel sibling), read on its decode without taking it;
- :mod:`.placement`: which prefill engine takes it (its prompts' prefix cache) and where its
  tokens are counted;
- :mod:`.dispatch`: P/D with a pull or a recompute, and a turn on one side alone when the
  other has no engine; :mod:`.push`: P/D with prefill writing into decode's blocks;
- :mod:`.decode`: decode's request and its reply, whole or streamed through :mod:`.relay`,
  which continues a stream whose decode broke off mid-reply on another engine
  (:mod:`.migrate`: what was sent, by token ids, and the continuation's shape);
- :mod:`.settle`: once the reply is over, counting it, recording where its KV now lives and
  freeing what nobody can come back for.

:mod:`.model` holds what they pass each other; :mod:`.context` what they share (the pools, the
table, the lease client, the learned costs, background work). Routing lives in
:mod:`kvturn.gateway.pools`, the decision's arithmetic in :mod:`kvturn.gateway.planner`.
"""
