"""A micro-batch's declared features as columns: the serving read of every declared
state for every transaction of the batch in a fixed number of array operations.

:func:`queue_batch` queues, per state and transaction with a key, one ``HMGET`` of the
key's tiles and newest events (the layout of ``fraud_scoring.declared``), then the
recording of the recorded transactions (the same script calls as the row-by-row path).
:func:`parse_batch` turns the replies into the declared columns:

* every state's tile rings of one record size are joined into one array, and every
  (state, window, transaction) is one row of a window table: its tiles are summed with
  ``bincount`` (count, sum, squares; min and max with ``reduceat``), its newest events
  give the time since the last one and the exact end (events at or after ``t`` in the
  tile holding ``t`` are taken out again), a categorical state's distinct values and
  ``changed`` flag come from its newest events and kept values, all as (rows x 32)
  arrays. No per-row Python objects: the cost is O(states) array operations plus a
  linear pass over the bytes read.
* rows that need an exactness correction go through the row-by-row definition
  (:func:`fraud_scoring.declared.online_row`) alone: attempts of one key recorded in the
  same micro-batch (a burst: they see each other in event-time order), and a min or max
  whose tile holding ``t`` also holds later events (a replay). Their cost is
  proportional to those rows.

The result equals :func:`fraud_scoring.declared.parse_batch` (the reference) row for row
(tests/test_declared_columnar.py); which reads were inexact is counted the same way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fraud_scoring.declared import kernels as K
from fraud_scoring.declared import window_table as W
from fraud_scoring.declared.kinds import KINDS, Sums
from fraud_scoring.declared.language import NEEDS_CATEGORY, NEWEST, US
from fraud_scoring.declared.microbatch import online_row, parse_reads, queue_recording
from fraud_scoring.declared.plan import Declarations, Spec
from fraud_scoring.declared.redis_tiles import BatchColumns, Event


@dataclass
class Plan:
    """What :func:`queue_batch` queued: per state the rows it read (those with a key) and
    their keys, and the recording (as :class:`fraud_scoring.declared.BatchPlan`)."""

    compiled: W.Compiled
    rows: list[np.ndarray]  # per state: the rows read (indexes into the batch)
    keys: list[list[str]]  # per state: their keys
    cols: BatchColumns  # the whole batch
    writes: list[tuple[list[tuple[Spec, list[str]]], bool, BatchColumns]]
    recorded: list[bool]

    @property
    def read_commands(self) -> int:
        """How many commands the reads queued (their replies come first): one per key."""
        return sum(map(len, self.keys))


def queue_batch(
    pipe: Any,
    decl: Declarations,
    cols: BatchColumns,
    record: Sequence[bool],
    horizon_s: float,
    *,
    writes_after: Callable[[], None] | None = None,
    per_key: bool = False,
) -> Plan:
    """Queue a micro-batch's reads (per state and row with a key its HMGET), then (after
    ``writes_after``, which may queue other writes) the recording of the rows whose
    ``record`` is true, as :func:`fraud_scoring.declared.queue_batch` does:
    :func:`queue_reads` then :func:`queue_writes`.

    The reads are plain ``HMGET``s, on one server as on a Cluster: one script returning
    them all cost the server ~4x their time (each ring copied into Lua and back) for one
    reply less to parse per key (docs/storage-layout.md)."""
    plan = queue_reads(pipe, decl, cols)
    if writes_after is not None:
        writes_after()
    queue_writes(pipe, plan, decl, record, horizon_s, per_key=per_key)
    return plan


def queue_reads(pipe: Any, decl: Declarations, cols: BatchColumns) -> Plan:
    """Queue a micro-batch's reads: per state and row with a key, one ``HMGET``. They do
    not depend on the rows' times, nor on which rows are recorded."""
    comp = W.compiled(decl.specs)
    keyed: dict[tuple[str, ...], tuple[np.ndarray, list[str]]] = {}
    plan = Plan(comp, [], [], cols, [], [])
    # A pipe that takes commands already in the protocol (the service's one server):
    # each HMGET from its state's fixed parts, not packed argument by argument.
    packed: Callable[[bytes], None] | None = getattr(pipe, "packed", None)
    for s, spec in enumerate(comp.specs):
        fields, head = comp.fields[s], comp.heads[s]
        got = keyed.get(spec.entity)
        if got is None:
            all_keys = cols.keys(spec.entity)
            idx = [i for i, k in enumerate(all_keys) if k is not None]
            present: list[str] = [k for k in all_keys if k is not None]
            got = keyed[spec.entity] = (np.asarray(idx, dtype=np.intp), present)
        rows, keys = got
        if packed is not None:
            for key in keys:
                packed(W.hmget(comp.packed[s], head + key + "}:t"))
        else:
            for key in keys:
                pipe.execute_command("HMGET", head + key + "}:t", *fields)
        plan.rows.append(rows)
        plan.keys.append(keys)
    return plan


def queue_writes(
    pipe: Any,
    plan: Plan,
    decl: Declarations,
    record: Sequence[bool],
    horizon_s: float,
    *,
    cols: BatchColumns | None = None,
    per_key: bool = False,
) -> None:
    """Queue the recording of the rows of ``plan``'s batch whose ``record`` is true;
    ``cols``: the batch with the times it is recorded and parsed at, when they differ
    from the reads' (the same rows and keys)."""
    if cols is not None:
        plan.cols = cols
    cols = plan.cols
    plan.recorded = list(record)
    kept = [i for i, r in enumerate(record) if r]
    rec = cols
    if len(kept) < len(record):
        rec = BatchColumns([cols.rows[i] for i in kept], [cols.ts_us[i] for i in kept])
    plan.writes = queue_recording(pipe, decl.specs, rec, horizon_s, per_key=per_key)


@dataclass(frozen=True)
class Read:
    """A micro-batch's declared columns (float64, one per declared feature), how many
    (state, row) reads were not exact, and per row with any the features they hold (a
    replay behind its key's present: never served as if exact)."""

    columns: dict[str, np.ndarray]
    inexact_reads: int
    inexact: dict[int, list[str]]


def needs_writes(plan: Plan) -> bool:
    """Whether :func:`parse_batch` needs the writes' replies: some key of the batch is
    recorded by one row and read by another (a burst, a busy merchant: the mates), or
    not every row is recorded. Otherwise the reads alone give the columns, and a caller
    may parse them while the server still runs the writes."""
    if not plan.writes or len(plan.cols.ts_us) < 2:  # a row is never its own mate
        return False
    rec = plan.writes[0][2]  # every write call records the same rows
    if rec is not plan.cols:
        return True
    return any(
        len(rows) > 1
        for spec in plan.compiled.specs
        if spec.source == "transactions"
        for rows in rec.groups(spec).values()
    )


_UNREAD = RuntimeError("the writes' replies were not needed")


def parse_batch(
    plan: Plan, reads: Sequence[Any], writes: Sequence[Any] | None, ts_us: Sequence[int]
) -> Read:
    """The declared columns of the micro-batch from its replies (``reads`` and
    ``writes`` in :func:`queue_batch`'s order; a failed write counts as not recorded;
    ``writes`` None: not read yet, allowed when not :func:`needs_writes`). Equal to
    :func:`fraud_scoring.declared.parse_batch` row for row, exactness included."""
    if writes is None:
        if needs_writes(plan):
            raise ValueError("this micro-batch's features need its writes' replies")
        writes = [_UNREAD] * len(plan.writes)  # skipped as failed writes: no mates
    with np.errstate(invalid="ignore"):  # floor_divide of -inf (no event) is NaN
        return _parse(plan, reads, writes, ts_us)


def _parse(plan: Plan, reads: Sequence[Any], writes: Sequence[Any], ts_us: Sequence[int]) -> Read:
    comp = plan.compiled
    n = len(ts_us)
    # Every (state, row) is a pair, a row without a key read as an empty key (its
    # features are then their defaults, as the row-by-row definition's): the window
    # table depends on the batch size alone, so it is built once per size.
    ix = W.index(comp, (n,) * len(comp.specs))
    per_state = np.empty((len(comp.specs), n))  # each pair's t: the row's, once per state
    per_state[:] = np.asarray(ts_us, dtype=np.float64)
    t = per_state.ravel()
    pairs = len(t)
    # The replies' fields in one list (state, row, field), a row without a key as
    # absent fields (None); the index picks each kind of field from it.
    if sum(map(len, plan.rows)) == pairs:  # every row has every state's key
        fields: list[bytes | None] = list(itertools.chain.from_iterable(reads))
    else:
        fields = []
        pos = 0
        for s, rows in enumerate(plan.rows):
            chunk: Sequence[Any] = reads[pos : pos + len(rows)]
            pos += len(rows)
            if len(rows) < n:
                full: list[Any] = [(None,) * len(comp.fields[s])] * n
                for at, i in enumerate(rows.tolist()):
                    full[i] = chunk[at]
                chunk = full
            fields.extend(itertools.chain.from_iterable(chunk))
    # Stored; whole tiles end before the tile holding t: what lies ahead is never read.
    ts_s, vs_s, ahead, n_ahead = W.newest_events(ix.newest(fields), t, ix.pair_whole)
    exact = n_ahead < NEWEST
    # The events this micro-batch recorded in the key before t (a burst): with the
    # stored ones for the newest event and the values, added to the windows below.
    mates = _mates(plan, writes, t[:n])
    ts_n, vs_n = ts_s, vs_s
    if mates is not None:
        m_ts, m_vs = W.by_pair(mates[0], mates[1], mates[2], pairs)
        ts_n, vs_n = np.concatenate([ts_s, m_ts], axis=1), np.concatenate([vs_s, m_vs], axis=1)
    _, last_v, since = K.last_events(ts_n, vs_n, t, float(US))
    cols: dict[str, np.ndarray] = {}
    fix: set[tuple[int, int]] = set()  # (state, pair): by the row-by-row definition
    counts: dict[tuple[int, int], np.ndarray] = {}  # (state, window): a values state's counts
    for tab in ix.tables:
        win = W.sum_windows(tab, ix.rings[tab.shape](fields), t)
        wp = tab.win_pair
        exact &= win.uncovered == 0
        c, s_, q = win.c, win.s, win.q
        if n_ahead.any():  # a replay: later events in t's tile are not before t
            edge = (np.floor_divide(t[wp], tab.win_width) * tab.win_width)[:, None]
            hit = ahead[wp] & (ts_s[wp] < edge + tab.win_width[:, None])  # in t's tile
            v = vs_s[wp]
            c = c - hit.sum(axis=1)
            s_ = s_ - (v * hit).sum(axis=1)
            q = q - (v * v * hit).sum(axis=1)
            for h, d in win.decayed.items():
                gap = np.where(hit, ts_s[wp] - t[wp][:, None], -np.inf)
                win.decayed[h] = d - (v * np.exp2(gap / h)).sum(axis=1)
            if tab.shape[0]:  # a min or max cannot be taken out: those rows row by row
                held = np.bincount(wp, weights=hit.any(axis=1).astype(np.float64), minlength=pairs)
                for pp in np.flatnonzero(held).tolist():
                    fix.add((pp // n, pp % n))
        if mates is not None:
            c, s_, q = W.add_mates(tab, mates, t, win, c, s_, q)
        if not exact.all():  # a replay: some later events were counted; never below nothing
            loose = ~exact[wp]
            c = np.where(loose, np.maximum(c, 0.0), c)
            s_ = np.where(loose, np.maximum(s_, 0.0), s_)
            q = np.where(loose, np.maximum(q, 0.0), q)
            for h, d in win.decayed.items():
                win.decayed[h] = np.where(loose, np.maximum(d, 0.0), d)
        agg = W.finish(
            tab.keys, c, s_, q, since[wp], last_v[wp], win.lo, win.hi, tab.win_us, win.decayed
        )
        sw = since[wp]
        for (s, j), at in tab.block.items():
            for f in comp.by_window.get((s, j), ()):
                if f.key in agg:
                    cols[f.name] = _column(agg, f, at, n, c, sw, tab.win_us)
            if s in ix.values:
                counts[(s, j)] = c[at : at + n]
    if ix.values:
        _values(comp, ix, plan, ix.kept(fields), (ts_n, vs_n, t, since), counts, cols)
    for st, i in sorted(fix):
        exact[st * n + i] = _by_row(plan, writes, reads, ts_us, st, i, cols)
    inexact: dict[int, list[str]] = {}
    if not exact.all():
        names = [spec.feature_names() for spec in comp.specs]
        for p in np.flatnonzero(~exact).tolist():
            inexact.setdefault(p % n, []).extend(names[p // n])
    return Read(cols, int(pairs - exact.sum()), inexact)


def warm(decl: Declarations) -> None:
    """Compile (or load from numba's cache) the window table's kernels for the arrays
    this path passes them, so that the first micro-batch does not pay it (about a
    second from the cache, more without): a micro-batch of one row with no key, parsed
    from its (empty) replies, calls every kernel the declarations need."""

    class _Nothing:
        def execute_command(self, *_args: Any) -> None:
            return None

    cols = BatchColumns([{"transaction_id": "warm-up"}], [0])
    plan = queue_reads(_Nothing(), decl, cols)
    parse_batch(plan, [], None, cols.ts_us)


def _column(
    agg: Mapping[str, np.ndarray],
    f: W.Feature,
    at: int,
    n: int,
    c: np.ndarray,
    since: np.ndarray,
    us: np.ndarray,
) -> np.ndarray:
    """One feature's column over the batch: its window rows, with a declared default
    where the window holds nothing."""
    v = agg[f.key][at : at + n]
    if f.default is not None:
        none = (
            since[at : at + n] > us[at : at + n] / US
            if KINDS[f.agg].exact_window
            else c[at : at + n] <= 0
        )
        v = np.where(none, f.default, v)
    return v


def _values(
    comp: W.Compiled,
    ix: W.Index,
    plan: Plan,
    kept: Sequence[bytes | None],
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    counts: Mapping[tuple[int, int], np.ndarray],
    cols: dict[str, np.ndarray],
) -> None:
    """distinct_count and changed of the states that keep values, over their window
    rows at once: from the key's newest events before t (``pairs``: the newest events'
    times and values, each pair's t and time since its last event) and the values
    pushed out of them (``kept``)."""
    ts_n, vs_n, t, since_p = pairs
    n = len(plan.cols.ts_us)
    codes_k, ts_k = W.kept_values(kept)
    mine_by: dict[str | None, np.ndarray] = {}
    for s in ix.values:  # each value column's codes once
        vc = comp.specs[s].value_column
        if vc not in mine_by:
            mine_by[vc] = _own(comp.specs[s], plan.cols)
    own = np.concatenate([mine_by[comp.specs[s].value_column] for s in ix.values])
    distinct, changed = K.values(
        ts_n,
        vs_n,
        ts_k,
        codes_k,
        own,
        ix.val_pair,
        ix.val_kept,
        ix.val_width,
        ix.val_tiles,
        ix.val_us,
        t,
    )
    sums = Sums(0.0, 0.0, 0.0, 0.0, 0.0, distinct=distinct, changed=changed)
    values = {a: KINDS[a].finish(sums) for a in NEEDS_CATEGORY}
    since = since_p[ix.val_pair]
    for (s, j), at in ix.val_block.items():
        w = comp.specs[s].windows[j]
        for f in comp.by_window.get((s, j), ()):
            if f.agg not in values:
                continue
            v = values[f.agg][at : at + n]
            if f.default is not None:  # a declared default where the window is empty
                exact_window = KINDS[f.agg].exact_window
                none = since[at : at + n] > w.us / US if exact_window else counts[(s, j)] <= 0
                v = np.where(none, f.default, v)
            cols[f.name] = v


def _own(spec: Spec, cols: BatchColumns) -> np.ndarray:
    """Each row's own value code (NaN: none, or not a categorical state)."""
    if not spec.categorical:
        return np.full(len(cols.ts_us), np.nan)
    raw = cols.column(spec.value_column)  # type: ignore[arg-type]
    codes = cols.values(spec)
    return np.array(
        [math.nan if _empty(v) else c for v, c in zip(raw, codes, strict=True)], dtype=np.float64
    )


def _empty(v: Any) -> bool:
    return v is None or v != v or v == ""


def _results(plan: Plan, writes: Sequence[Any]) -> dict[str, np.ndarray]:
    """Per state (by id), which of its recorded events were new to the store (in the
    order of :meth:`BatchColumns.groups`: keys, then rows); a failed write: none."""
    out: dict[str, np.ndarray] = {}
    per_key: dict[str, dict[str, list[int]]] = {}
    for (states, one_call, _), reply in zip(plan.writes, writes, strict=True):
        if isinstance(reply, Exception):
            continue
        if one_call:
            for (spec, _keys), part in zip(states, reply, strict=True):
                raw = part if isinstance(part, bytes) else str(part).encode()
                out[spec.id] = np.frombuffer(raw, dtype=np.uint8) == ord("1")
        else:
            ((spec, (key,)),) = states  # a Redis Cluster: one APPLY call per key
            per_key.setdefault(spec.id, {})[key] = [int(x) for x in reply[0]]
    if per_key:
        rec = plan.writes[0][2]
        for spec in plan.compiled.specs:
            got = per_key.get(spec.id)
            if got is not None:
                groups = rec.groups(spec)
                flat = [a for k, g in groups.items() for a in got.get(k, [0] * len(g))]
                out[spec.id] = np.asarray(flat, dtype=np.int64) == 1
    return out


def _mates(
    plan: Plan, writes: Sequence[Any], t: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The events this micro-batch recorded, new to the store, in each row's key before
    its time and not its own transaction: (pair, time, value) arrays; None: there are
    none (no key read by a row is recorded by another row: the common case). ``t``:
    each row's time."""
    n = len(t)
    if not plan.writes or n < 2:  # a row is never its own mate
        return None
    rec = plan.writes[0][2]  # every write call records the same rows
    results: dict[str, np.ndarray] | None = None
    tid: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.intp), np.zeros(0, np.intp))
    # Per key grouping (shared by the states of one entity and filter): each recorded
    # event's row in ``rec``, and the (row, event) pairs of one key, not one transaction.
    matched: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    rec_ts: np.ndarray | None = None
    rec_values: dict[str | None, np.ndarray] = {}
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for s, spec in enumerate(plan.compiled.specs):
        if spec.source != "transactions":
            continue
        groups = rec.groups(spec)
        if not groups or (rec is plan.cols and len(groups) == len(rec.ids)):
            continue  # every recorded row its own key, read by itself only
        if results is None:
            results = _results(plan, writes)
            code = {x: j for j, x in enumerate(plan.cols.ids)}
            tid = (
                np.fromiter(map(code.__getitem__, plan.cols.ids), np.intp, n),
                np.fromiter(map(code.__getitem__, rec.ids), np.intp, len(rec.ids)),
            )
        fresh = results.get(spec.id)
        if fresh is None or not fresh.any():
            continue
        got = matched.get(id(groups))
        if got is None:
            sizes = list(map(len, groups.values()))
            events = np.fromiter(itertools.chain.from_iterable(groups.values()), np.intp)
            key = np.repeat(np.arange(len(groups)), sizes)
            kid = dict(zip(groups, range(len(groups)), strict=True))
            keys = plan.cols.keys(spec.entity)  # every row's (None: none)
            pk = np.fromiter(map(kid.get, keys, itertools.repeat(-1)), np.intp, n)  # type: ignore[arg-type]
            lo = np.searchsorted(key, pk, "left")
            hi = np.where(pk >= 0, np.searchsorted(key, pk, "right"), lo)
            row, at = W.expand(hi - lo, lo)
            other = tid[0][row] != tid[1][events[at]]
            got = matched[id(groups)] = (events, row[other], at[other])
        events, row, at = got
        if rec_ts is None:
            rec_ts = np.asarray(rec.ts_us, dtype=np.float64)
        ev_ts = rec_ts[events[at]] + spec.delay_us
        ok = fresh[at] & (ev_ts < t[row])
        values = rec_values.get(spec.value_column)
        if values is None:
            values = rec_values[spec.value_column] = np.asarray(rec.values(spec), np.float64)
        ev_v = values[events[at[ok]]]
        parts.append((s * n + row[ok], ev_ts[ok], ev_v))
    if not sum(len(p[0]) for p in parts):
        return None
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
    )


def _fresh(plan: Plan, writes: Sequence[Any], spec: Spec, key: str) -> list[Event]:
    """The events of ``key`` this micro-batch recorded in ``spec`` that were new to the
    store (as :func:`fraud_scoring.declared.parse_batch` finds them)."""
    for (recorded, one_call, batch), reply in zip(plan.writes, writes, strict=True):
        if isinstance(reply, Exception):
            continue
        for (sp, keys), part in zip(recorded, reply if one_call else [reply], strict=True):
            if sp is not spec or key not in keys:
                continue
            if one_call:  # one character per event of the state's keys, in order
                groups, at = batch.groups(sp), 0
                for k in keys:
                    if k == key:
                        break
                    at += len(groups[k])
                results = [{ord("1"): 1}.get(x, 0) for x in part[at : at + len(groups[key])]]
            else:
                results = dict(zip(keys, part, strict=True))[key]
            evs = batch.events(sp, key)
            return [e for e, a in zip(evs, results, strict=True) if int(a) == 1]
    return []


def _by_row(
    plan: Plan,
    writes: Sequence[Any],
    reads: Sequence[Any],
    ts_us: Sequence[int],
    s: int,
    i: int,
    cols: dict[str, np.ndarray],
) -> bool:
    """Row ``i`` of state ``s`` by the row-by-row definition, written into ``cols``;
    returns whether it is exact."""
    spec = plan.compiled.specs[s]
    local = int(np.searchsorted(plan.rows[s], i))
    key = plan.keys[s][local]
    t = ts_us[i]
    reply = reads[sum(map(len, plan.rows[:s])) + local]
    state = parse_reads(spec, [reply], [t])[0]
    row = plan.cols.rows[i]
    tid = str(row["transaction_id"])
    mates = [e for e in _fresh(plan, writes, spec, key) if e.transaction_id != tid]
    feats, exact = online_row(spec, state, t, mates, spec.own_code(row))
    for name, v in feats.items():
        cols[name][i] = v
    return exact
