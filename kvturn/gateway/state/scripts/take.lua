-- A turn starts: its KV comes off the table for this turn alone, and it gets its number.
-- KEYS: entry, live-lease index, entry index. ARGV: conversation id, turn id ('' none), now,
-- ttl ms, epoch, settle window s ('': take whatever is under way), the turn the request
-- extends ('': any). Returns the entry as it was (its 'seen': before this take), or
-- {'settling', 1} (nothing changed) while a reply marked within the window records, or the
-- entry and {'moved', 1} (nothing changed) where it recorded a turn newer than the one the
-- request extends (a fork).
-- The retained KV's fields (what a take clears): holder, rid, held, digest, dtok, salt, mark,
-- expires.
local h = KEYS[1]
if ARGV[6] ~= '' then
  local at = redis.call('HGET', h, 'settling_at')
  if at and tonumber(ARGV[3]) - tonumber(at) <= tonumber(ARGV[6]) then
    return {'settling', 1}
  end
end
if ARGV[7] ~= '' then
  local recorded = redis.call('HGET', h, 'recorded')
  if recorded and tonumber(recorded) > tonumber(ARGV[7]) then
    local entry = redis.call('HGETALL', h)
    table.insert(entry, 'moved')
    table.insert(entry, 1)
    return entry
  end
end
if redis.call('EXISTS', h) == 0 then
  redis.call('HSET', h, 'cid', ARGV[1], 'epoch', ARGV[5], 'turns', 0, 'recorded', 0,
             'retries', 0, 'heartbeats', 0)
end
local retry = 0
local last = redis.call('HGET', h, 'turn_id')
if ARGV[2] ~= '' and last == ARGV[2] then
  retry = 1
  redis.call('HINCRBY', h, 'retries', 1)
end
redis.call('HSET', h, 'turn_id', ARGV[2])
local turn = redis.call('HINCRBY', h, 'turns', 1)
local entry = redis.call('HGETALL', h)
redis.call('HSET', h, 'seen', ARGV[3])
redis.call('HDEL', h, 'holder', 'rid', 'held', 'digest', 'dtok', 'salt', 'mark',
             'expires')
redis.call('PEXPIRE', h, ARGV[4])
redis.call('ZREM', KEYS[2], h)
redis.call('ZADD', KEYS[3], ARGV[3], h)
table.insert(entry, 'retry')
table.insert(entry, retry)
return entry
