-- A turn's reply is under way: next turns wait for its record a while. (make.lua precedes.)
-- KEYS: entry, entry index, implicit index key. ARGV: turn, now, ttl ms, a fresh turn's
-- conversation id, its epoch, the implicit index's value.
local h = KEYS[1]
make(h, KEYS[2], ARGV[4], ARGV[5], ARGV[1], ARGV[2], ARGV[3])
index(h, KEYS[3], ARGV[6], ARGV[3])
local recorded = redis.call('HGET', h, 'recorded')
if recorded and tonumber(recorded) < tonumber(ARGV[1]) then
  redis.call('HSET', h, 'settling', ARGV[1], 'settling_at', ARGV[2])
end
return 0
