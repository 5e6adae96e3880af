-- A state's settings: ARGV[pos] packs them as little-endian doubles (horizon_us, newest,
-- ttl_ms, backfill (1/0), dcap, dback_us, extremes (1/0), nwidths, (u, slots)*, nhalf,
-- half_life_us*, mark_ttl_ms (0: the ids are the key's sorted set; > 0: per-transaction
-- markers that live this long)), one struct.unpack instead of a tonumber per setting;
-- ARGV[pos + 1 ..] each width's field name (its u as text). Returns them (record's c)
-- and the position after.
local function config(pos)
  local head = ARGV[pos]
  local v = {struct.unpack('<' .. string.rep('d', #head / 8), head)}
  local nw = v[8]
  local widths, fields = {}, {}
  for w = 1, nw do
    -- per width (flat, no table each): its µs and its slots; its field: fields[w]
    widths[2*w - 1], widths[2*w] = v[7 + 2*w], v[8 + 2*w]
    fields[w] = ARGV[pos + w]
  end
  fields[nw + 1], fields[nw + 2], fields[nw + 3], fields[nw + 4] = 'n', 'f', 'b', 'd'
  local hp = 9 + 2 * nw
  local halves = {}
  for h = 1, v[hp] do halves[h] = v[hp + h] end
  -- a tile's record: index, count, sum, squares; min and max; a decayed sum per half-life
  local ext = v[7] == 1
  local nf = 4 + (ext and 2 or 0) + #halves
  return {v[1], v[2], v[3], v[4] == 1, v[5], v[6], nw, widths, fields, 8 * nf, ext, halves,
    '<' .. string.rep('d', nf), v[hp + 1 + #halves]}, pos + 1 + nw
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

-- Add the event (ts, x) to its tile of every width: ``tiles[w][idx]`` the sums of this
-- call's events in that tile, as pack_tile takes them.
local function add_tiles(tiles, nw, widths, halves, ts, x)
  for w = 1, nw do
    local u = widths[2*w - 1]
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
end

-- The record of tile ``idx`` of ``ring``: its position, or nil (not held). ``top``: the
-- tile of the key's newest event before this call (nil: none); every tile held lies at
-- or before it (tiles and `n` are written together), so a later tile is new, with no
-- search of the ring.
local function find_tile(ring, rs, idx, top)
  local last = #ring - rs + 1
  -- the newest tile (live): the ring's last record (idx is a whole number, never -0)
  if last >= 1 and struct.unpack('<d', ring, last) == idx then return last end
  if top and idx > top then return nil end  -- a tile after every held one: appended
  local needle, at = struct.pack('<d', idx), 0
  repeat  -- the record of this tile, if held (a match must start a record)
    at = string.find(ring, needle, at + 1, true)
  until at == nil or at % rs == 1
  return at
end

-- Scratch tables, one per script call: add_one's record with decayed sums; no tiles;
-- record's HSET arguments (with their count: entries past it are stale).
local pk, NONE, SET = {}, {}, {}

-- ``ring`` with the one event (ts, x) of this call added to its tile of width ``u``, as
-- add_tiles and the loop over tiles in record() leave it for a single event (the same
-- sums, in the same order of operations: the same bytes), without their tables: the
-- held record's fields are read into locals. Returns the ring and whether it grew.
local function add_one(ring, rs, fmt, ext, halves, u, top, ts, x)
  local idx = (ts - math.fmod(ts, u)) / u
  local at = find_tile(ring, rs, idx, top)
  local nh = #halves
  local n, s, q, lo, hi = 1, 0 + x, 0 + x * x, x, x
  if at then
    local _, hn, hs, hq = struct.unpack('<dddd', ring, at)
    n, s, q = n + hn, s + hs, q + hq
    if ext then
      local hlo, hhi = struct.unpack('<dd', ring, at + 32)
      lo, hi = math.min(lo, hlo), math.max(hi, hhi)
    end
  end
  local rec
  if nh == 0 then
    if ext then rec = struct.pack(fmt, idx, n, s, q, lo, hi)
    else rec = struct.pack(fmt, idx, n, s, q) end
  else
    pk[1], pk[2], pk[3], pk[4] = idx, n, s, q
    local k = 4
    if ext then pk[5], pk[6], k = lo, hi, 6 end
    for h = 1, nh do
      local d = 0 + x * 2 ^ ((ts - (idx + 1) * u) / halves[h])
      if at then d = d + struct.unpack('<d', ring, at + 8 * (k + h - 1)) end
      pk[k + h] = d
    end
    rec = struct.pack(fmt, unpack(pk, 1, k + nh))
  end
  if at and at + rs > #ring then
    return ring:sub(1, at - 1) .. rec, false
  elseif at then
    return ring:sub(1, at - 1) .. rec .. ring:sub(at + rs), false
  end
  return ring .. rec, true
end

-- Record one key's events: ``nev`` of them, ``ev(e)`` -> id, ts (µs), value (numbers).
-- Idempotency: ``kid`` the key's sorted set of ids; or nil, and then ``seen(e)`` says
-- whether the event's transaction is recorded in this state already and ``mark(e)``
-- records that it now is (per-transaction markers, kept by the caller).
local function record(kt, kid, c, nev, ev, seen, mark, out)
  local horizon, keep, ttl, backfill, dcap, dback, nw, widths, fields, rs, ext, halves, fmt =
    unpack(c)
  out = out or {}
  if not kid then
    -- Every event's transaction recorded here already (a second recorder: the streaming
    -- updater after the service's read-your-writes): nothing to read or write.
    local e = 1
    while e <= nev and seen(e) do e = e + 1 end
    if e > nev then
      for k = 1, nev do out[k] = 0 end
      return out
    end
  end
  local held = redis.call('HMGET', kt, unpack(fields))
  local recent = held[nw + 1] or ''
  -- f: the oldest event recorded live; b: the newest recorded by a backfill
  local first = held[nw + 2] and tonumber(held[nw + 2])
  local back = held[nw + 3] and tonumber(held[nw + 3])
  local back0 = back  -- as before this call: events of one time all count (labels share one)
  local first0 = first
  local newest = nil
  if #recent > 0 then newest = struct.unpack('<d', recent, #recent - 15) end
  local newest0 = newest  -- as before this call
  -- ts1, x1: the one event added so far, its tiles not built yet (the common live case:
  -- one event per key and call, recorded by add_one); tiles: the sums per width and tile
  -- of this call's events, built from the second one on (the first's added first)
  local tiles, added, ts1, x1 = nil, false, nil, nil
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
      if not added and ts - ts == 0 then  -- the first, at a finite time
        ts1, x1 = ts, x
      else
        if not tiles then
          tiles = {}
          for w = 1, nw do tiles[w] = {} end
        end
        if ts1 then add_tiles(tiles, nw, widths, halves, ts1, x1); ts1 = nil end
        add_tiles(tiles, nw, widths, halves, ts, x)
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
    local set, ns = SET, 0
    for w = 1, nw do
      local ring = held[w] or ''
      local grew = false
      local u = widths[2*w - 1]
      local top = newest0 and (newest0 - math.fmod(newest0, u)) / u
      if ts1 then
        ring, grew = add_one(ring, rs, fmt, ext, halves, u, top, ts1, x1)
      end
      for idx, t in pairs(tiles and tiles[w] or NONE) do
        local at = find_tile(ring, rs, idx, top)
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
      local slots = widths[2*w]
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
      set[ns + 1], set[ns + 2], ns = fields[w], ring, ns + 2
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
          end  -- else (held older) its record goes, below
          if pos ~= -1 then
            -- the first record left (d's first, or its second where pos is 1): where
            -- it sorts after (ts, c) (the live case), the record goes first, in one copy
            local f, c2, t2 = pos == 1 and 17 or 1
            if f <= #d then c2, t2 = struct.unpack('<dd', d, f) end
            if f > #d or t2 < ts or (t2 == ts and c2 > c) then
              if pos then
                d = struct.pack('<dd', c, ts) .. d:sub(1, pos - 1) .. d:sub(pos + 16)
              else
                d = struct.pack('<dd', c, ts) .. d
              end
            else
              if pos then d = d:sub(1, pos - 1) .. d:sub(pos + 16) end
              local ins = 1  -- before the first record that sorts after (ts, c)
              while ins <= #d do
                c2, t2 = struct.unpack('<dd', d, ins)
                if t2 < ts or (t2 == ts and c2 > c) then break end
                ins = ins + 16
              end
              d = d:sub(1, ins - 1) .. struct.pack('<dd', c, ts) .. d:sub(ins)
            end
          end
        end
        -- the dcap newest, none older than dback behind the key's newest (at the end)
        local n = math.min(#d / 16, dcap)
        while n > 0 and struct.unpack('<d', d, 16 * n - 7) < newest - dback do n = n - 1 end
        set[ns + 1], set[ns + 2], ns = 'd', 16 * n == #d and d or d:sub(1, 16 * n), ns + 2
      end
      recent = recent:sub(cut + 1)
    end
    set[ns + 1], set[ns + 2], ns = 'n', recent, ns + 2
    -- f and b as held are not written again (this script writes them, as '%d' text)
    if first and first ~= first0 then
      set[ns + 1], set[ns + 2], ns = 'f', string.format('%d', first), ns + 2
    end
    if back and back ~= back0 then
      set[ns + 1], set[ns + 2], ns = 'b', string.format('%d', back), ns + 2
    end
    redis.call('HSET', kt, unpack(set, 1, ns))
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
