-- A heartbeat: the entry as it is, counted as one.
-- KEYS: entry, entry index. ARGV: now, ttl ms.
local h = KEYS[1]
if redis.call('EXISTS', h) == 0 then return {} end
redis.call('HINCRBY', h, 'heartbeats', 1)
redis.call('HSET', h, 'seen', ARGV[1])
redis.call('PEXPIRE', h, ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[1], h)
return redis.call('HGETALL', h)
