"""record.lua's single-event fast path leaves the bytes the general path left.

Random event sequences (live, bursts, duplicates, out of order, backfills, events behind
the horizon, min/max, decayed sums, kept values) are recorded by the scripts built from
the current ``record.lua`` and ``apply_states.lua`` and by the scripts as they were before
the fast path (``ORIGINAL_RECORD_LUA`` and ``ORIGINAL_APPLY_STATES_LUA``, below, as
committed in ea22b88), into two databases of one real server: every reply and every key's
bytes must be the same. (The current scripts take a state's settings packed in one
argument, :func:`_packed`; the originals each number as text. And they skip a key whose
events were all recorded already without reading it: the same replies and bytes.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fraud_scoring.declared import redis_tiles

# fraud_scoring/declared/record.lua as of commit ea22b88 (before the fast path).
ORIGINAL_RECORD_LUA = r"""
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
"""[1:]  # (the text from its second line)

# fraud_scoring/declared/apply_states.lua as of commit ea22b88.
ORIGINAL_APPLY_STATES_LUA = r"""local n = tonumber(ARGV[1])
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
for s, st in ipairs(states) do
  local c, delay, vals, keys = st[1], st[2], st[3], st[4]
  local sid = sids[s]
  if c[14] > markttl then markttl = c[14] end
  local codes = {}
  for key in string.gmatch(keys, '([^;]*);') do
    local rows = {}
    for i in string.gmatch(key, '%d+') do rows[#rows + 1] = tonumber(i) end
    local out = record(KEYS[kpos], nil, c, #rows, function(e)
      local i = rows[e]
      return ids[i], times[i] + delay, vals and vals[i] or 1.0
    end, function(e)
      return seen[ids[rows[e]]][sid]
    end, function(e)
      local id = ids[rows[e]]
      seen[id][sid] = true
      local a = added[id]
      a[#a + 1] = sid
      a[#a + 1] = '1'
    end)
    for e = 1, #out do codes[#codes + 1] = code[out[e]] end
    kpos = kpos + 1
  end
  result[s] = table.concat(codes)
end
for j, id in ipairs(order) do
  if #added[id] > 0 then
    local mk = KEYS[nstatekeys + j]
    redis.call('HSET', mk, unpack(added[id]))
    redis.call('PEXPIRE', mk, markttl)
  end
end
return result
"""

ORIGINAL_APPLY = "\n" + ORIGINAL_RECORD_LUA + "\n" + redis_tiles._lua("apply.lua")
ORIGINAL_APPLY_STATES = "\n" + ORIGINAL_RECORD_LUA + "\n" + ORIGINAL_APPLY_STATES_LUA


@pytest.fixture()
def dbs(redis_server: str) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    base = redis_server.rsplit("/", 1)[0]  # the URL names database 0
    new, old = redis.Redis.from_url(base + "/14"), redis.Redis.from_url(base + "/15")
    for c in (new, old):
        c.flushdb()
    yield new, old
    for c in (new, old):
        c.flushdb()
        c.close()


def _config(rng: random.Random) -> tuple[list[Any], bool]:
    """A state's settings (APPLY's ARGV up to mark_ttl_ms excluded) and whether it backfills."""
    nw = rng.randint(1, 3)
    us = sorted(rng.sample([7, 10, 25, 60, 100, 250, 1000], nw))
    widths: list[Any] = []
    for u in us:
        widths += (u, rng.randint(2, 12))
    halves = sorted(rng.sample([13, 50, 400], rng.choice([0, 0, 1, 2])))
    backfill = rng.random() < 0.2
    dcap = rng.choice([0, 0, 3, 8])
    cfg = [
        rng.choice([300, 2000, 10**6]),
        rng.choice([2, 4, 32]),
        600000,
        int(backfill),
        dcap,
        rng.choice([100, 5000]),
        rng.choice([0, 1]),
        nw,
        *widths,
        len(halves),
        *halves,
    ]
    return cfg, backfill


def _packed(cfg: list[Any], mark_ttl: int) -> list[Any]:
    """The settings as the scripts now take them: the numbers packed in one argument,
    then each width's field name (the original took each number as text)."""
    nw = cfg[7]
    return [redis_tiles.pack_settings([*cfg, mark_ttl]), *map(str, cfg[8 : 8 + 2 * nw : 2])]


def _value(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.05:
        return rng.choice(["-0.0", "0.0", "inf", "-inf", "nan", "1e300", "-1e300"])
    if r < 0.4:
        return repr(float(rng.randint(1, 5)))  # a few codes (kept values repeat)
    return repr(rng.uniform(-50, 500))


def _events(
    rng: random.Random, n: int, clock: list[int], ids: list[str]
) -> list[tuple[str, int, str]]:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.1 and ids:  # a duplicate transaction
            out.append((rng.choice(ids), clock[0] - rng.randint(0, 50), _value(rng)))
            continue
        if r < 0.25:  # out of order, now and then behind the horizon
            ts = clock[0] - rng.choice([1, 5, 30, 200, 3000, 10**6 + 5])
        else:  # live: the same tile, or later
            clock[0] += rng.choice([0, 0, 1, 3, 8, 40, 120, 900, 5000])
            ts = clock[0]
        tid = f"t{len(ids)}"
        ids.append(tid)
        out.append((tid, ts, _value(rng)))
    return out


def _same_bytes(new: Any, old: Any) -> int:
    keys = sorted(old.keys("*"))
    assert sorted(new.keys("*")) == keys
    for k in keys:
        kind = old.type(k)
        assert new.type(k) == kind, k
        if kind == b"hash":
            assert new.hgetall(k) == old.hgetall(k), k
        elif kind == b"zset":
            assert new.zrange(k, 0, -1, withscores=True) == old.zrange(k, 0, -1, withscores=True), k
        else:
            raise AssertionError(f"{k!r}: {kind!r}")
        assert (new.pttl(k) > 0) == (old.pttl(k) > 0), k
    return len(keys)


@pytest.mark.parametrize("seed", range(12))
def test_apply_same_bytes_as_the_original(dbs: tuple[redis.Redis, redis.Redis], seed: int) -> None:
    """APPLY_LUA (one state's keys; ids per key, markers, or none) on both scripts."""
    new, old = dbs
    rng = random.Random(seed)
    for state in range(3):
        cfg, _ = _config(rng)
        mark_ttl = rng.choice([0, 600000, -1])
        keys = [f"k{i}" for i in range(rng.randint(1, 4))]
        clocks = {k: [10**6 + rng.randint(0, 10**4)] for k in keys}
        ids: list[str] = []
        for _ in range(40):
            picked = rng.sample(keys, rng.randint(1, len(keys)))
            by_key = {
                k: _events(rng, rng.choice([1, 1, 1, 1, 2, 3, 6]), clocks[k], ids) for k in picked
            }
            names: list[str] = []
            for k in picked:
                t = f"{{s{state}:{k}}}:t"
                names += [t, f"{{s{state}:{k}}}:ids"] if mark_ttl == 0 else [t]
            evs = [e for k in picked for e in by_key[k]]
            if mark_ttl > 0:
                names += [f"m:{{{e[0]}}}" for e in evs]
            args: list[Any] = [f"s{state}", len(evs) if mark_ttl > 0 else 0]
            for k in picked:
                args.append(len(by_key[k]))
                for e in by_key[k]:
                    args += e
            replies = [
                c.eval(script, len(names), *names, *head, *args)
                for c, script, head in (
                    (new, redis_tiles.APPLY_LUA, _packed(cfg, mark_ttl)),
                    (old, ORIGINAL_APPLY, [*cfg, mark_ttl]),
                )
            ]
            assert replies[0] == replies[1]
    assert _same_bytes(new, old) > 0


@pytest.mark.parametrize("seed", range(12))
def test_apply_states_same_bytes_as_the_original(
    dbs: tuple[redis.Redis, redis.Redis], seed: int
) -> None:
    """APPLY_STATES_LUA (a micro-batch in several states, markers) on both scripts."""
    new, old = dbs
    rng = random.Random(1000 + seed)
    states = [_config(rng)[0] for _ in range(rng.randint(1, 4))]
    entities = [f"e{i}" for i in range(rng.randint(1, 6))]
    clock, ids = [10**6], list[str]()
    for _ in range(30):
        n = rng.choice([1, 1, 3, 8, 24])
        rows = []
        for _ in range(n):
            ((tid, ts, _v),) = _events(rng, 1, clock, ids)
            rows.append(
                (tid, ts, [_value(rng) for _ in range(2)], [rng.choice(entities) for _ in states])
            )
        args: list[Any] = [
            n,
            "".join(r[0] + "\x1f" for r in rows),
            "".join(f"{r[1]}," for r in rows),
            2,
            "".join(r[2][0] + "," for r in rows),
            "".join(("" if rng.random() < 0.1 else r[2][1]) + "," for r in rows),
            len(states),
        ]
        names: list[str] = []
        args_new = list(args)
        for s, cfg in enumerate(states):
            by_key: dict[str, list[int]] = {}
            for i, r in enumerate(rows):
                by_key.setdefault(r[3][s], []).append(i + 1)
            rest = [
                rng.choice([0, 0, 7]),
                rng.randint(0, 2),
                "".join(",".join(map(str, v)) + ";" for v in by_key.values()),
                f"s{s}",
            ]
            args += [*cfg, 600000, *rest]
            args_new += [*_packed(cfg, 600000), *rest]
            names += [f"{{s{s}:{k}}}:t" for k in by_key]
        names += [f"m:{{{i}}}" for i in dict.fromkeys(r[0] for r in rows)]
        replies = [
            c.eval(script, len(names), *names, *a)
            for c, script, a in (
                (new, redis_tiles.APPLY_STATES_LUA, args_new),
                (old, ORIGINAL_APPLY_STATES, args),
            )
        ]
        assert replies[0] == replies[1]
    assert _same_bytes(new, old) > 0
