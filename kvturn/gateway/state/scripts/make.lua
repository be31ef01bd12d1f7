-- Shared by the writes (settling.lua, record.lua; prepended to each as they are loaded):
-- make the entry a fresh turn started (its conversation id, '': not fresh), if there is
-- none; index it by a turn's messages (the implicit index's key, '': none), if it exists.
local function make(h, seen, cid, epoch, turn, now, ttl)
  if cid ~= '' and redis.call('EXISTS', h) == 0 then
    redis.call('HSET', h, 'cid', cid, 'epoch', epoch, 'turns', turn, 'recorded', 0,
               'retries', 0, 'heartbeats', 0, 'seen', now)
    redis.call('PEXPIRE', h, ttl)
    redis.call('ZADD', seen, now, h)
  end
end
local function index(h, key, value, ttl)
  if key ~= '' and redis.call('EXISTS', h) == 1 then
    redis.call('SET', key, value, 'PX', ttl)
  end
end
