-- A turn is over: where its KV now lives, fenced by turn number and epoch. (make.lua precedes.)
-- KEYS: entry, live-lease index, entry index, implicit index key ('': none). ARGV: epoch,
-- turn, ttl ms, now, a fresh turn's conversation id ('': not fresh), the implicit index's
-- value, then (when something is held) holder, request id, tokens, digest, digest tokens,
-- salt, expires at, prompt mark. Returns {kept (0/1), replaced holder, replaced request id}.
local h = KEYS[1]
make(h, KEYS[3], ARGV[5], ARGV[1], ARGV[2], ARGV[4], ARGV[3])
index(h, KEYS[4], ARGV[6], ARGV[3])
local cur = redis.call('HMGET', h, 'epoch', 'recorded', 'holder', 'rid', 'settling')
if cur[1] ~= ARGV[1] then
  if #ARGV > 6 then return {0} end
  return {1}
end
local turn = tonumber(ARGV[2])
if cur[5] and tonumber(cur[5]) <= turn then
  redis.call('HDEL', h, 'settling', 'settling_at')
end
if #ARGV == 6 then return {1} end
if tonumber(cur[2]) > turn then return {0} end
redis.call('HSET', h, 'recorded', turn, 'holder', ARGV[7], 'rid', ARGV[8], 'held', ARGV[9],
           'digest', ARGV[10], 'dtok', ARGV[11], 'salt', ARGV[12], 'expires', ARGV[13],
           'mark', ARGV[14], 'seen', ARGV[4])
redis.call('PEXPIRE', h, ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[13], h)
if cur[3] and cur[4] and cur[4] ~= ARGV[8] then return {1, cur[3], cur[4]} end
return {1}
