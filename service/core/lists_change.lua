-- One change to a list (service/core/lists.py), atomic with its audit entries.
-- KEYS: the items hash (value -> expires_at, epoch s, 0: never), the meta hash (value ->
-- JSON: who added it, why, when), the audit stream (append-only).
-- ARGV: op ('add' | 'remove'), max_items, key_id, now (epoch s), then per item:
-- value, expires_at, reason, meta JSON ('add'), or value, reason ('remove').
-- Returns the number of items added (new values) or removed; an addition that would take
-- the list past max_items changes nothing and answers an error starting TOO_MANY.
local op, max_items, key_id, now = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local changed = 0
if op == 'add' then
  local new = 0
  for i = 5, #ARGV, 4 do
    if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then new = new + 1 end
  end
  local held = redis.call('HLEN', KEYS[1])
  if held + new > max_items then
    return redis.error_reply('TOO_MANY ' .. held .. ' held, ' .. new .. ' new, at most ' .. max_items)
  end
  for i = 5, #ARGV, 4 do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 3])
    redis.call('XADD', KEYS[3], '*', 'op', 'add', 'value', ARGV[i], 'expires_at', ARGV[i + 1],
      'key_id', key_id, 'reason', ARGV[i + 2], 'at', now)
  end
  return new
end
for i = 5, #ARGV, 2 do
  if redis.call('HDEL', KEYS[1], ARGV[i]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('XADD', KEYS[3], '*', 'op', 'remove', 'value', ARGV[i], 'expires_at', '',
      'key_id', key_id, 'reason', ARGV[i + 1], 'at', now)
    changed = changed + 1
  end
end
return changed
