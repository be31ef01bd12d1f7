-- Release: the entry, gone from the table.
-- KEYS: entry, live-lease index, entry index.
local entry = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('ZREM', KEYS[3], KEYS[1])
return entry
