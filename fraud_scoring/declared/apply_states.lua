local n = tonumber(ARGV[1])
local ids, times = {}, {}
for x in string.gmatch(ARGV[2], '([^\031]*)\031') do ids[#ids + 1] = x end
for x in string.gmatch(ARGV[3], '([^,]*),') do times[#times + 1] = tonumber(x) end
assert(#ids == n and #times == n, 'ids and times must hold n rows')
local ncol = tonumber(ARGV[4])
local cols = {}
for k = 1, ncol do
  local col = {}
  for x in string.gmatch(ARGV[4 + k], '([^,]*),') do col[#col + 1] = tonumber(x) or false end
  assert(#col == n, 'a value column must hold n rows')
  cols[k] = col
end
-- The transactions' markers: the last KEYS, one per distinct id in order of its first
-- row; each is read once (the fields of this call's states) and written once.
local order, marker = {}, {}
for i = 1, n do
  if not marker[ids[i]] then order[#order + 1] = ids[i]; marker[ids[i]] = #order end
end
local nstatekeys = #KEYS - #order
local states, sids = {}, {}
local pos, kpos = 6 + ncol, 1
for s = 1, tonumber(ARGV[5 + ncol]) do
  local c
  c, pos = config(pos)
  states[s] = {c, tonumber(ARGV[pos]), cols[tonumber(ARGV[pos + 1])], ARGV[pos + 2]}
  sids[s] = ARGV[pos + 3]
  pos = pos + 4
end
local seen, added, markttl = {}, {}, 0
for j, id in ipairs(order) do
  local got = redis.call('HMGET', KEYS[nstatekeys + j], unpack(sids))
  local held = {}
  for s = 1, #sids do if got[s] then held[sids[s]] = true end end
  seen[id], added[id] = held, {}
end
local code = {[1] = '1', [0] = '0', [-1] = '-'}
local result = {}
-- The key being recorded: its rows; its state's delay, value column and id (record's
-- callbacks read them: three functions for the whole call, not three per key).
local rows, delay, vals, sid
local function ev(e)
  local i = rows[e]
  return ids[i], times[i] + delay, vals and vals[i] or 1.0
end
local function was_seen(e)
  return seen[ids[rows[e]]][sid]
end
local function mark(e)
  local id = ids[rows[e]]
  seen[id][sid] = true
  local a = added[id]
  a[#a + 1] = sid
  a[#a + 1] = '1'
end
local one = {}  -- the rows of a key with one (most keys): no table per key
-- scratch: a key's results (record's out), a state's codes (entries past nc are stale)
local out, codes = {}, {}
for s, st in ipairs(states) do
  local c, keys = st[1], st[4]
  delay, vals, sid = st[2], st[3], sids[s]
  if c[14] > markttl then markttl = c[14] end
  local nc = 0
  for key in string.gmatch(keys, '([^;]*);') do
    if string.find(key, '%D') then  -- not one position
      rows = {}
      for i in string.gmatch(key, '%d+') do rows[#rows + 1] = tonumber(i) end
    else
      rows = one
      one[1] = tonumber(key)
    end
    local nev = #rows
    record(KEYS[kpos], nil, c, nev, ev, was_seen, mark, out)
    for e = 1, nev do codes[nc + e] = code[out[e]] end
    nc = nc + nev
    kpos = kpos + 1
  end
  result[s] = table.concat(codes, '', 1, nc)
end
for j, id in ipairs(order) do
  if #added[id] > 0 then
    local mk = KEYS[nstatekeys + j]
    redis.call('HSET', mk, unpack(added[id]))
    redis.call('PEXPIRE', mk, markttl)
  end
end
return result
