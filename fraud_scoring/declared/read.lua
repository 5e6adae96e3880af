-- Read many keys' hashes in one call: KEYS: the hashes (":t"), in order. ARGV: ngroups,
-- then per group: nfields, its fields, nkeys (the next nkeys of KEYS share those fields).
-- Returns per key HMGET's reply (a list, "" for a field the hash lacks), in KEYS order.
local out, k, a = {}, 1, 2
for _ = 1, tonumber(ARGV[1]) do
  local nf = tonumber(ARGV[a])
  local fields = {unpack(ARGV, a + 1, a + nf)}
  local nk = tonumber(ARGV[a + nf + 1])
  a = a + nf + 2
  for _ = 1, nk do
    local got = redis.call('HMGET', KEYS[k], unpack(fields))
    for i = 1, nf do
      if not got[i] then got[i] = '' end
    end
    out[k] = got
    k = k + 1
  end
end
return out
