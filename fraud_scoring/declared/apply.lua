local c, pos = config(1)
local result = {}
for g = 1, #KEYS / 2 do
  local nev, at = tonumber(ARGV[pos]), pos
  result[g] = record(KEYS[2*g - 1], KEYS[2*g], c, nev, function(e)
    return ARGV[at + 3*e - 2], tonumber(ARGV[at + 3*e - 1]), tonumber(ARGV[at + 3*e])
  end)
  pos = pos + 1 + 3 * nev
end
return result
