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
local pos, kpos = 6 + ncol, 1
local code = {[1] = '1', [0] = '0', [-1] = '-'}
local result = {}
for s = 1, tonumber(ARGV[5 + ncol]) do
  local c
  c, pos = config(pos)
  local delay, vals = tonumber(ARGV[pos]), cols[tonumber(ARGV[pos + 1])]
  local codes = {}
  for key in string.gmatch(ARGV[pos + 2], '([^;]*);') do
    local rows = {}
    for i in string.gmatch(key, '%d+') do rows[#rows + 1] = tonumber(i) end
    local out = record(KEYS[kpos], KEYS[kpos + 1], c, #rows, function(e)
      local i = rows[e]
      return ids[i], times[i] + delay, vals and vals[i] or 1.0
    end)
    for e = 1, #out do codes[#codes + 1] = code[out[e]] end
    kpos = kpos + 2
  end
  pos = pos + 3
  result[s] = table.concat(codes)
end
return result
