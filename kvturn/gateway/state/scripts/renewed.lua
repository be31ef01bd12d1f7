-- The holder's answer to a heartbeat for a lease.
-- KEYS: entry, live-lease index. ARGV: request id, expires at ('' : gone), ttl ms.
local h = KEYS[1]
if redis.call('HGET', h, 'rid') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then
  redis.call('HDEL', h, 'holder', 'rid', 'held', 'digest', 'dtok', 'salt', 'mark',
             'expires')
  redis.call('ZREM', KEYS[2], h)
  return 0
end
redis.call('HSET', h, 'expires', ARGV[2])
redis.call('PEXPIRE', h, ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[2], h)
return 1
