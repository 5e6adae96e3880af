local c, pos = config(1)
local sid, markttl = ARGV[pos], c[14]
pos = pos + 1
-- markttl 0: KEYS t, ids per key; > 0: t per key, then one marker per event; < 0: t
-- per key, no ids at all (a backfill's events behind the live horizon)
local nkeys = markttl ~= 0 and #KEYS - tonumber(ARGV[pos]) or #KEYS / 2
pos = pos + 1
-- With markers, KEYS: each key's hash, then one marker per event (in order): the
-- transaction's field sid is set when this state records it.
local result, at_ev = {}, 0
for g = 1, nkeys do
  local nev, at, first_ev = tonumber(ARGV[pos]), pos, at_ev
  local kt, kid = KEYS[g], nil
  if markttl == 0 then kt, kid = KEYS[2*g - 1], KEYS[2*g] end
  result[g] = record(kt, kid, c, nev, function(e)
    return ARGV[at + 3*e - 2], tonumber(ARGV[at + 3*e - 1]), tonumber(ARGV[at + 3*e])
  end, function(e)
    return markttl > 0 and redis.call('HEXISTS', KEYS[nkeys + first_ev + e], sid) == 1
  end, function(e)
    if markttl < 0 then return end
    local mk = KEYS[nkeys + first_ev + e]
    redis.call('HSET', mk, sid, '1')
    redis.call('PEXPIRE', mk, markttl)
  end)
  at_ev = at_ev + nev
  pos = pos + 1 + 3 * nev
end
return result
