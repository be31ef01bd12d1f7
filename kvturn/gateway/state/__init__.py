"""The gateway's state: what outlives a request, in this process or shared in Redis.

Below the turn path and the HTTP app (they use it; it knows nothing of them), and the only part
of the gateway that talks to Redis:

- :mod:`.table`: the conversation table's interface (:class:`~.table.ConversationTable`) and
  its entries; :mod:`.table_in_process` and :mod:`.table_redis` implement it (the Redis one's
  atomic steps are the Lua scripts of ``scripts/``, loaded by :mod:`.lua`).
- :mod:`.implicit`: the implicit conversations' index, kept where the table is.
- :mod:`.response_store`: the Responses API's stored responses and conversations.
- :mod:`.redis_client`: the one Redis client, timeout and outage account they share.
- :mod:`.stores`: all of them, as a gateway's ``state`` setting names them.

A store that cannot be reached raises :class:`kvturn.gateway.errors.StateUnavailable`.
"""
