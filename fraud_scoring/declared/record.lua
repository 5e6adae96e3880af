-- A state's settings from ARGV[pos]: horizon_us, newest, ttl_ms, backfill (1/0), dcap,
-- dback_us, extremes (1/0), nwidths, (u, slots)*, nhalf, half_life_us*, mark_ttl_ms (0:
-- the ids are the key's sorted set; > 0: per-transaction markers that live this long).
-- Returns them (record's c) and the position after.
local function config(pos)
  local nw = tonumber(ARGV[pos + 7])
  local widths, fields = {}, {}
  for w = 1, nw do
    local u = ARGV[pos + 6 + 2*w]
    widths[w] = {u, tonumber(u), tonumber(ARGV[pos + 7 + 2*w])}
    fields[w] = u
  end
  fields[nw + 1], fields[nw + 2], fields[nw + 3], fields[nw + 4] = 'n', 'f', 'b', 'd'
  local hp = pos + 8 + 2 * nw
  local halves = {}
  for h = 1, tonumber(ARGV[hp]) do halves[h] = tonumber(ARGV[hp + h]) end
  -- a tile's record: index, count, sum, squares; min and max; a decayed sum per half-life
  local ext = ARGV[pos + 6] == '1'
  local nf = 4 + (ext and 2 or 0) + #halves
  return {tonumber(ARGV[pos]), tonumber(ARGV[pos + 1]), tonumber(ARGV[pos + 2]),
    ARGV[pos + 3] == '1', tonumber(ARGV[pos + 4]), tonumber(ARGV[pos + 5]), nw, widths,
    fields, 8 * nf, ext, halves, '<' .. string.rep('d', nf),
    tonumber(ARGV[hp + 1 + #halves])}, hp + 2 + #halves
end

-- A tile's record from its sums t = {idx, count, sum, squares, min, max, decayed*}.
local function pack_tile(fmt, ext, t)
  if ext then return struct.pack(fmt, unpack(t)) end
  return struct.pack(fmt, t[1], t[2], t[3], t[4], unpack(t, 7))
end

-- The sums of the record at ``at`` of ``ring`` (as pack_tile takes them).
local function unpack_tile(fmt, ext, ring, at)
  local r = {struct.unpack(fmt, ring, at)}
  r[#r] = nil  -- the position after
  if not ext then table.insert(r, 5, -math.huge); table.insert(r, 5, math.huge) end
  return r
end

-- Record one key's events: ``nev`` of them, ``ev(e)`` -> id, ts (µs), value (numbers).
-- Idempotency: ``kid`` the key's sorted set of ids; or nil, and then ``seen(e)`` says
-- whether the event's transaction is recorded in this state already and ``mark(e)``
-- records that it now is (per-transaction markers, kept by the caller).
local function record(kt, kid, c, nev, ev, seen, mark)
  local horizon, keep, ttl, backfill, dcap, dback, nw, widths, fields, rs, ext, halves, fmt =
    unpack(c)
  local held = redis.call('HMGET', kt, unpack(fields))
  local recent = held[nw + 1] or ''
  -- f: the oldest event recorded live; b: the newest recorded by a backfill
  local first = held[nw + 2] and tonumber(held[nw + 2])
  local back = held[nw + 3] and tonumber(held[nw + 3])
  local back0 = back  -- as before this call: events of one time all count (labels share one)
  local newest = nil
  if #recent > 0 then newest = struct.unpack('<d', recent, #recent - 15) end
  local newest0 = newest  -- as before this call
  local out, tiles, added = {}, {}, false
  for w = 1, nw do tiles[w] = {} end
  for e = 1, nev do
    local id, ts, x = ev(e)
    if backfill and ((back0 and ts <= back0) or (first and ts >= first)) then
      out[e] = 0  -- recorded by an earlier backfill, or live (the stream has it)
    elseif (kid and redis.call('ZSCORE', kid, id)) or (not kid and seen(e)) then
      out[e] = 0
    elseif newest and ts < newest - horizon then
      out[e] = -1
    else
      if kid then redis.call('ZADD', kid, ts, id) else mark(e) end
      for w = 1, nw do
        local u = widths[w][2]
        local idx = (ts - math.fmod(ts, u)) / u
        local t = tiles[w][idx]
        if t == nil then
          t = {idx, 0, 0, 0, x, x}
          for h = 1, #halves do t[6 + h] = 0 end
          tiles[w][idx] = t
        end
        t[2], t[3], t[4] = t[2] + 1, t[3] + x, t[4] + x * x
        if x < t[5] then t[5] = x end
        if x > t[6] then t[6] = x end
        -- decayed to the tile's end: x * 2^((ts - end) / half-life)
        for h = 1, #halves do t[6 + h] = t[6 + h] + x * 2 ^ ((ts - (idx + 1) * u) / halves[h]) end
      end
      local at = #recent + 1  -- keep `recent` in time order: insert after any <= ts
      while at > 1 and struct.unpack('<d', recent, at - 16) > ts do at = at - 16 end
      if at > #recent then  -- the newest (live): appended, no copy of the rest
        recent = recent .. struct.pack('<dd', ts, x)
      else
        recent = recent:sub(1, at - 1) .. struct.pack('<dd', ts, x) .. recent:sub(at)
      end
      if not newest or ts > newest then newest = ts end
      if backfill then
        if not back or ts > back then back = ts end
      elseif not first or ts < first then
        first = ts
      end
      out[e] = 1
      added = true
    end
  end
  if added then
    local set = {}
    for w = 1, nw do
      local ring = held[w] or ''
      local grew = false
      -- Every tile held lies at or before the key's newest event's (tiles and `n` are
      -- written together): a later tile is new, with no search of the ring.
      local top = newest0 and (newest0 - math.fmod(newest0, widths[w][2])) / widths[w][2]
      for idx, t in pairs(tiles[w]) do
        local needle, at = struct.pack('<d', idx), 0
        if #ring >= rs and ring:sub(#ring - rs + 1, #ring - rs + 8) == needle then
          at = #ring - rs + 1  -- the newest tile (live): the ring's last record
        elseif top and idx > top then
          at = nil  -- a tile after every held one: appended
        else
          repeat  -- the record of this tile, if held (a match must start a record)
            at = string.find(ring, needle, at + 1, true)
          until at == nil or at % rs == 1
        end
        local sums = t
        if at then  -- the held tile's sums with this call's
          local h = unpack_tile(fmt, ext, ring, at)
          sums = {idx, t[2] + h[2], t[3] + h[3], t[4] + h[4], math.min(t[5], h[5]),
            math.max(t[6], h[6])}
          for k = 7, #t do sums[k] = t[k] + h[k] end
        end
        local rec = pack_tile(fmt, ext, sums)
        if at and at + rs > #ring then
          ring = ring:sub(1, at - 1) .. rec
        elseif at then
          ring = ring:sub(1, at - 1) .. rec .. ring:sub(at + rs)
        else
          ring = ring .. rec
          grew = true
        end
      end
      local slots = widths[w][3]
      if grew and #ring > rs * slots then  -- keep the tiles of the last `slots` indexes
        local top, recs = -1, {}
        for at = 1, #ring, rs do
          local idx = struct.unpack('<d', ring, at)
          recs[#recs + 1] = {idx, at}
          if idx > top then top = idx end
        end
        local kept = {}
        for _, r in ipairs(recs) do
          if r[1] > top - slots then kept[#kept + 1] = ring:sub(r[2], r[2] + rs - 1) end
        end
        ring = table.concat(kept)
      end
      set[#set + 1] = widths[w][1]
      set[#set + 1] = ring
    end
    if #recent > 16 * keep then
      local cut = #recent - 16 * keep
      if dcap > 0 then  -- the values pushed out: their newest time per value
        -- d is kept newest first, then by code (the same bytes however the values
        -- arrived): each pushed-out value replaces its older record, at its place.
        local d = held[nw + 4] or ''
        for at = 1, cut, 16 do
          local ts, c = struct.unpack('<dd', recent, at)
          local needle, pos = struct.pack('<d', c), 0
          repeat  -- the value's record, if held (a match must start a record)
            pos = string.find(d, needle, pos + 1, true)
          until pos == nil or pos % 16 == 1
          if pos and struct.unpack('<d', d, pos + 8) >= ts then
            pos = -1  -- held with a newer (or the same) time: unchanged
          elseif pos then
            d = d:sub(1, pos - 1) .. d:sub(pos + 16)
          end
          if pos ~= -1 then
            local ins = 1  -- before the first record that sorts after (ts, c)
            while ins <= #d do
              local c2, t2 = struct.unpack('<dd', d, ins)
              if t2 < ts or (t2 == ts and c2 > c) then break end
              ins = ins + 16
            end
            d = d:sub(1, ins - 1) .. struct.pack('<dd', c, ts) .. d:sub(ins)
          end
        end
        -- the dcap newest, none older than dback behind the key's newest (at the end)
        local n = math.min(#d / 16, dcap)
        while n > 0 and struct.unpack('<d', d, 16 * n - 7) < newest - dback do n = n - 1 end
        set[#set + 1] = 'd'
        set[#set + 1] = d:sub(1, 16 * n)
      end
      recent = recent:sub(cut + 1)
    end
    set[#set + 1] = 'n'
    set[#set + 1] = recent
    if first then set[#set + 1] = 'f'; set[#set + 1] = string.format('%d', first) end
    if back then set[#set + 1] = 'b'; set[#set + 1] = string.format('%d', back) end
    redis.call('HSET', kt, unpack(set))
    -- The ids behind the horizon go, and the expiry moves, when the key is new or its
    -- newest event enters another minute: once a minute at most, not for every event
    -- (the ids then span at most the horizon and a minute; the expiry, hours, moves at
    -- most a minute late).
    if not newest0 or math.floor(newest / 6e7) ~= math.floor(newest0 / 6e7) then
      redis.call('PEXPIRE', kt, ttl)
      if kid then
        redis.call('ZREMRANGEBYSCORE', kid, '-inf', '(' .. string.format('%d', newest - horizon))
        redis.call('PEXPIRE', kid, ttl)
      end
    end
  end
  return out
end
