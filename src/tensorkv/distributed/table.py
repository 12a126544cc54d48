"""ShardedEmbeddingTable: the EmbeddingTable API over the shards of a parameter server.

Keys go to shard ``shard_of_keys(key, num_shards)`` (:mod:`tensorkv.checkpoint.layout`), the
hash ranges sharded checkpoints use, so a checkpoint saved from N shards restores onto M. A
batch is deduplicated on the client (each distinct key sent once with its count, gradients
summed per key in input order with the table's own kernel), split by shard, and sent as one
request per shard, all in flight together; numpy arrays travel through Ray's object store.
Each shard applies its requests in the order the client sent them, so one client's results
are bit-identical to a single-process :class:`~tensorkv.EmbeddingTable` (only the
``mutation_seq`` counters differ: each shard counts its own). A change that spans several
shards is one :class:`~tensorkv.distributed.channel.Op`, staged on each, then committed: it
lands on every shard or on none.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from tensorkv.checkpoint.layout import shard_of_keys
from tensorkv.distributed.channel import Channel, Op, ray_module, save_barrier
from tensorkv.distributed.ops import MAX_IN_FLIGHT
from tensorkv.embedding.chunks import ExportChunk, is_single_chunk, nonfinite_rows
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.keys import as_int64_keys
from tensorkv.errors import (
    ConfigError,
    NonFiniteGradientError,
    NonFiniteValueError,
    ShapeError,
)
from tensorkv.kernels import hashindex as hk
from tensorkv.kernels import shards as sk


class Split:
    """A batch of keys, deduplicated and split by shard.

    Attributes
    ----------
    uniq, inverse, counts
        Distinct keys in order of first sighting, each key's position among them, and how
        often each was seen.
    order, bounds
        ``uniq[order[bounds[s]:bounds[s + 1]]]`` are shard ``s``'s keys (first-sighting order
        kept).
    dest
        Each sighting's key's place in that order.
    """

    def __init__(self, keys: np.ndarray, num_shards: int, uniq: np.ndarray | None = None,
                 inverse: np.ndarray | None = None) -> None:
        n = keys.shape[0]
        if uniq is None or inverse is None:
            tab = np.empty(hk.map_slots(n), np.int32)
            uniq_buf = np.empty(n, np.int64)
            inverse = np.empty(n, np.int64)
            u = hk.map_distinct(keys, tab, uniq_buf, inverse) if n else 0
            uniq = uniq_buf[:u]
        self.keys = keys
        self.uniq = uniq
        self.inverse = inverse
        u = uniq.shape[0]
        self.order = np.empty(u, np.int64)
        self.bounds = np.empty(num_shards + 1, np.int64)
        self.dest = np.empty(n, np.int64)  # each sighting's key's place in shard order
        self.counts = np.empty(u, np.int64)
        sk.split_by_shard(uniq, inverse, num_shards, self.order, self.bounds, self.dest,
                          self.counts)

    def part(self, s: int) -> np.ndarray:
        """Positions (in ``uniq``) of shard ``s``'s keys."""
        return self.order[self.bounds[s]:self.bounds[s + 1]]


class SeqMap:
    """Shard change counters -> the table's :attr:`~ShardedEmbeddingTable.mutation_seq`.

    For every operation that changed shard ``s``, the shard's counter and the table's after
    it; a row's change number on a shard maps to the table's scale (aligned at the end of its
    operation), and a table counter value to each shard's (for ``export(since=...)``). Keeps
    the newest ``limit`` operations per shard; older values map by the oldest known offset.
    """

    def __init__(self, num_shards: int, limit: int = 1 << 20) -> None:
        self.shard: list[list[int]] = [[] for _ in range(num_shards)]
        self.table: list[list[int]] = [[] for _ in range(num_shards)]
        self.limit = limit

    def record(self, s: int, shard_seq: int, table_seq: int) -> None:
        """Operation done: shard ``s``'s counter is ``shard_seq``, the table's ``table_seq``."""
        sh, tb = self.shard[s], self.table[s]
        sh.append(shard_seq)
        tb.append(table_seq)
        if len(sh) > 2 * self.limit:
            del sh[:self.limit], tb[:self.limit]

    def global_seq(self, s: int, seqs: np.ndarray) -> np.ndarray:
        """Change numbers of rows of shard ``s`` on the table's scale."""
        if not self.shard[s] or not seqs.size:
            return seqs
        sh = np.asarray(self.shard[s], np.int64)
        tb = np.asarray(self.table[s], np.int64)
        i = np.minimum(np.searchsorted(sh, seqs, side="left"), sh.size - 1)
        return tb[i] - (sh[i] - seqs)

    def shard_seq(self, s: int, table_seq: int) -> int:
        """Shard ``s``'s counter when the table's was ``table_seq``."""
        tb = self.table[s]
        if not tb:
            return int(table_seq) if not self.shard[s] else 0
        i = int(np.searchsorted(np.asarray(tb, np.int64), table_seq, side="right")) - 1
        if i < 0:
            return int(self.shard[s][0] - (tb[0] - table_seq)) if table_seq >= 0 else -1
        return int(self.shard[s][i])



def resolve_tag(url: str, tag: str) -> str:
    """``tag``, or the newest tag of ``url`` for ``"latest"`` (ConfigError if it has none)."""
    if tag != "latest":
        return tag
    from tensorkv.checkpoint import latest_tag

    found = latest_tag(url)
    if found is None:
        raise ConfigError(f"no tag in {url!r} to load")
    return found

class ShardedEmbeddingTable:
    """An embedding table whose rows live on the shards of a :class:`ParameterServer`.

    Made by :meth:`ParameterServer.table`; it has the methods and semantics of
    :class:`~tensorkv.EmbeddingTable` (``lookup``, ``apply_gradients``, ``upsert``,
    ``remove``, ``export``/``import_``, ``len``, ``stats``, ``prefetch`` ...), so
    ``tensorkv.torch`` modules, ``tensorkv.save`` and ``tensorkv.load`` take it as they take a
    local table.

    Parameters
    ----------
    channel
        The client's link to the shards.
    name
        The table's name on the parameter server.
    dim
        Row width.
    spec
        The arguments the table was created with (``optimizer``, ``nan_policy`` ...).
    mode
        ``"sync"``: every update is acknowledged before the call returns. ``"async"``:
        ``apply_gradients`` returns once its requests are sent; at most ``staleness``
        batches of this client are unacknowledged at a time (errors surface on a later
        call). Each shard still applies one client's requests in the order sent, so a lookup
        sees all of the client's earlier updates; another client's updates may be up to
        ``staleness`` of its batches behind.
    staleness
        Unacknowledged batches allowed in ``"async"`` mode.
    """

    def __init__(self, channel: Channel, name: str, dim: int, spec: dict[str, Any],
                 mode: str = "sync", staleness: int = 2) -> None:
        if mode not in ("sync", "async"):
            raise ConfigError(f"mode={mode!r} must be 'sync' or 'async'")
        if isinstance(staleness, bool) or not isinstance(staleness, int) or \
                not 1 <= staleness <= MAX_IN_FLIGHT:
            raise ConfigError(f"staleness={staleness!r} must be an int from 1 to {MAX_IN_FLIGHT}")
        self.channel = channel
        self.name = name
        self.dim = int(dim)
        self.spec = dict(spec)
        self.nan_policy = str(spec.get("nan_policy", "raise"))
        self.dtype = str(spec.get("dtype", "float32"))
        self.mode = mode
        self.staleness = staleness
        self.storage = spec.get("storage")
        self._collisions = 0
        self._inflight: collections.deque[Any] = collections.deque()  # updates in flight
        # (keys, split, peek requests sent after the last update or None, sequence mark)
        self._prefetch: tuple[np.ndarray, Split, list[tuple[int, Any, Any]] | None,
                              int] | None = None
        self._seq_map = SeqMap(channel.num_shards)
        self._split: tuple[np.ndarray, Split] | None = None  # the last lookup's keys, split
        self._eviction = Eviction.from_config(spec.get("eviction"))
        self._admission = spec.get("admission") is not None
        # mutation_seq as the single-process table counts it: one operation grows it as much
        # as it grows the counter of the shard it grows most; ``_own_seq`` sums what this
        # client's requests added on the shards, so others' changes count too
        self._own_seq = 0
        self._seq = 0
        self._seq_base = 0
        self._seq = self._seq_base = sum(self._shard_seqs())

    # --- plumbing -----------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Number of shards the rows are spread over."""
        return self.channel.num_shards

    @property
    def device(self) -> str:
        """Rows come back to the client in host memory: ``"cpu"``."""
        return "cpu"

    def _send_all(self, method: str, args_of: Any, mutating: bool,
                  shards: Any = None) -> Any:
        """Send a request to every shard (or ``shards``).

        A change of several shards goes out as one :class:`~tensorkv.distributed.channel.Op`
        (staged); anything else as ``[(shard, ref, request)]``.
        """
        ch = self.channel
        shards = list(range(ch.num_shards) if shards is None else shards)
        if mutating and len(shards) > 1:
            return Op(ch, method, self.name, args_of, shards, self.dim)
        out = []
        for s in shards:
            ref, req = ch.send(s, method, self.name, args_of(s), mutating, self.dim)
            out.append((s, ref, req))
        return out

    @staticmethod
    def _shards_of(sent: Any) -> list[int]:
        return list(sent.shards) if isinstance(sent, Op) else [x[0] for x in sent]

    def _gather(self, sent: Any) -> list[Any]:
        """The results of requests sent together; counts their ``mutation_seq`` growth."""
        if isinstance(sent, Op):
            answers = list(zip(sent.shards, sent.results(), strict=True))
        else:
            answers = [(s, self.channel.result(s, ref, req)) for s, ref, req in sent]
        out, grew, changed = [], 0, []
        for s, (value, delta, seq) in answers:
            out.append(value)
            if delta:
                self._own_seq += delta
                grew = max(grew, delta)
                changed.append((s, seq))
        self._seq += grew  # one operation: as much as the reference counts for it
        for s, seq in changed:
            self._seq_map.record(s, seq, self._seq)
        return out

    def _call(self, method: str, *args: Any, mutating: bool = False,
              shards: Any = None) -> list[Any]:
        """Call a table method on every shard (or ``shards``); the results by shard."""
        self.drain()
        return self._gather(self._send_all("call", lambda s: (method, args), mutating, shards))

    def drain(self) -> None:
        """Wait for every update in flight (``"async"`` mode) and raise a failed one's error."""
        self._advance(block=True)
        while self._inflight:
            self._gather(self._inflight.popleft())

    def _advance(self, block: bool) -> None:
        """Commit the updates in flight whose parts are all staged, in the order sent.

        ``block``: wait for every stage answer (nothing of ours may come between an update
        and the requests after it). An update a save barrier refused is redone, and so is
        every update sent after it (each in turn): the shards still apply them in order.
        """
        ops = [x for x in self._inflight if isinstance(x, Op) and x.committed is None]
        for i, op in enumerate(ops):
            if not block and not op.ready():
                return
            try:
                if op.decide():
                    continue
            except Exception:
                self._inflight.remove(op)  # aborted everywhere: its error is raised once
                raise
            later = ops[i + 1:]
            for x in later:
                x.withdraw()
            op.run()
            for x in later:
                x.redo()
            return

    def as_keys(self, keys: Any) -> np.ndarray:
        """``keys`` as the table stores them: a 1-D int64 array (str/bytes hashed)."""
        k, collisions = as_int64_keys(keys)
        self._collisions += collisions
        return k

    def _by_shard(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sid = shard_of_keys(k, self.num_shards)
        order = np.argsort(sid, kind="stable")
        return order, np.searchsorted(sid[order], np.arange(self.num_shards + 1))

    # --- lookups ------------------------------------------------------------------------------
    def _send_pull(self, sp: Split, insert: bool, method: str = "pull",
                   touch: bool = False) -> list[tuple[int, Any, Any]]:
        shards = [s for s in range(self.num_shards) if sp.bounds[s + 1] > sp.bounds[s]]

        def args(s: int) -> tuple:
            p = sp.part(s)
            kc = np.stack([sp.uniq[p], sp.counts[p]])
            return (kc,) if method == "peek" else (kc, insert, touch)

        return self._send_all(method, args, insert and method == "pull", shards)

    def _rows_of(self, sp: Split, sent: Any, out: np.ndarray | None,
                 peeked: list[tuple[int, Any, Any]] | None = None) -> np.ndarray:
        u = sp.uniq.shape[0]
        n = sp.keys.shape[0]
        before = {} if peeked is None else dict(zip([x[0] for x in peeked],
                                                    self._gather(peeked), strict=True))
        got = self._gather(sent)
        shards = self._shards_of(sent)
        if peeked is None and all(isinstance(r, np.ndarray) and r.shape[0] ==
                                  sp.bounds[s + 1] - sp.bounds[s]
                                  for s, r in zip(shards, got, strict=True)):
            # every shard's rows per key: straight into batch order, one pass each
            res = np.empty((n, self.dim), np.float32) if out is None else out
            dest = sp.dest
            for s, rows in zip(shards, got, strict=True):
                sk.gather_part(rows, dest, int(sp.bounds[s]), int(sp.bounds[s + 1]), res)
            return res
        urows = np.empty((u, self.dim), np.float32)
        per_sighting = []
        for s, rows in zip(shards, got, strict=True):
            p = sp.part(s)
            if isinstance(rows, tuple) and s in before:  # a touch: peeked rows, new keys' rows
                absent, new_rows = rows
                urows[p] = before[s]
                urows[p[absent]] = new_rows
            elif rows.shape[0] == p.shape[0]:
                urows[p] = rows
            else:
                per_sighting.append((s, rows))
        res = np.empty((n, self.dim), np.float32) if out is None else out
        np.take(urows, sp.inverse, axis=0, out=res)
        if per_sighting:  # sightings of one key read differently (admission mid-batch)
            rank = np.empty(u, np.int64)
            rank[sp.order] = np.arange(u)
            by_key = np.argsort(rank[sp.inverse], kind="stable")
            ends = np.cumsum(sp.counts[sp.order])
            for s, rows in per_sighting:
                lo = int(ends[sp.bounds[s] - 1]) if sp.bounds[s] else 0
                res[by_key[lo:lo + rows.shape[0]]] = rows
        return res

    def lookup(self, keys: Any, insert: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``keys`` as a float32 ``[n, dim]`` array (see ``EmbeddingTable.lookup``).

        One request per shard holding some of the keys, all in flight together; each
        distinct key travels once (with its count). A :meth:`prefetch` of the same keys
        made since the last update sent the request already.
        """
        k = self.as_keys(keys)
        if insert and k.shape[0] == 0:
            self._seq += 1  # the reference counts an empty lookup too
        if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float32
                                or out.shape != (k.shape[0], self.dim)
                                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ShapeError(
                f"out must be a writeable C-contiguous float32 array of shape ({k.shape[0]}, "
                f"{self.dim}); got {getattr(out, 'dtype', type(out).__name__)} "
                f"{getattr(out, 'shape', '')}")
        if self._inflight:  # our updates land before this lookup reads
            self._advance(block=True)
        pre, self._prefetch = self._prefetch, None
        same = pre is not None and np.array_equal(pre[0], k)
        sp = pre[1] if pre is not None and same else Split(k, self.num_shards)
        self._split = (k.copy() if pre is None or not same else pre[0], sp)
        if (pre is not None and same and insert and pre[2] is not None
                and pre[3] == sum(self.channel.seq)):
            # nothing of ours changed since the peek: only new keys' rows come back now
            return self._rows_of(sp, self._send_pull(sp, True, touch=True), out, pre[2])
        return self._rows_of(sp, self._send_pull(sp, insert), out)

    def lookup_torch(self, keys: Any, insert: bool = True) -> Any:
        """:meth:`lookup` as a float32 torch tensor (on the CPU)."""
        from tensorkv.errors import import_optional

        torch = import_optional("torch", "lookup_torch", "torch")
        return torch.from_numpy(self.lookup(keys, insert=insert))

    def __getitem__(self, keys: Any) -> np.ndarray:
        """``table[keys]`` is ``lookup(keys, insert=False)``."""
        return self.lookup(keys, insert=False)

    def prefetch(self, keys: Any) -> None:
        """Prepare the lookup of the next batch's keys and overlap its pull with this step.

        Call it with batch ``i + 1``'s keys after batch ``i``'s lookup: the keys are
        deduplicated and split now, and a read of their rows (a *peek*, which changes
        nothing, not even counters) is sent right behind batch ``i``'s
        :meth:`apply_gradients` requests, so each shard answers it after applying them while
        the client goes on with its step. The :meth:`lookup` of those keys then brings back
        only the rows of keys that had none (it still counts every sighting and inserts new
        keys, as a lookup does); if this client changed the table in between, it is an
        ordinary lookup. Values never depend on it. With several clients, rows may miss
        other clients' updates that land between the peek and the lookup (at most one step).
        """
        k = self.as_keys(keys)
        self._prefetch = (k.copy(), Split(k, self.num_shards), None, -1)

    def _mutating(self) -> None:
        """Before an operation other than lookup/apply_gradients: drop the prefetch."""
        self._prefetch = None
        self.drain()

    # --- updates ------------------------------------------------------------------------------
    def apply_gradients(self, keys: Any, grads: Any, step: int | None = None, *,
                        unique: bool = False) -> int:
        """Apply one sparse optimizer step (see ``EmbeddingTable.apply_gradients``).

        Gradients are summed per key on the client; every shard gets one request (the ones
        without keys still count the step, so all shards agree on it). Returns the number of
        rows updated (in ``"async"`` mode, the number of distinct keys sent). ``unique`` is
        accepted as ``EmbeddingTable`` takes it: the grouping by shard sums in the same pass.
        """
        k = self.as_keys(keys)
        g = np.asarray(grads)
        n = k.shape[0]
        if g.dtype.kind != "f":
            raise ShapeError(
                f"gradients have dtype {g.dtype}; pass a float array of shape ({n}, {self.dim})")
        if g.shape != (n, self.dim):
            raise ShapeError(
                f"gradients have shape {g.shape} but {n} keys of dim={self.dim} need shape "
                f"({n}, {self.dim})")
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int,
                                                                                 np.integer))):
            raise ConfigError(f"step={step!r} must be an integer or None")
        g = np.ascontiguousarray(g, dtype=np.float32)
        # distinct keys grouped by shard (as the lookup of these keys split them); each one's
        # gradients summed straight into its place
        last, self._split = self._split, None
        sp = (last[1] if last is not None and last[1].bounds.shape[0] == self.num_shards + 1
              and np.array_equal(last[0], k) else Split(k, self.num_shards))
        u = sp.uniq.shape[0]
        at = -(-u * 8 // 64) * 64
        st = self.channel.staging(at + u * self.dim * 4) if u else None
        if st is not None:  # built where the shards read them
            uniq = st.array(0, np.int64, (u,))
            sums = st.array(at, np.float32, (u, self.dim))
        else:
            uniq, sums = np.empty(u, np.int64), np.empty((u, self.dim), np.float32)
        np.take(sp.uniq, sp.order, out=uniq)
        bad = np.empty(u, np.bool_)
        if n:
            sk.sum_rows_at(g, sp.dest, np.zeros(u, np.bool_), sums, bad)
        if bad.any() and self.nan_policy == "raise":
            bad_keys = uniq[bad]
            raise NonFiniteGradientError(
                f"gradients for {bad_keys.size} keys hold NaN or Inf (keys "
                f"{np.sort(bad_keys)[:8].tolist()}{' ...' if bad_keys.size > 8 else ''}); "
                "the table is unchanged. Fix the loss, clip gradients, or create the table "
                "with nan_policy='skip' to skip such keys")
        pre = self._prefetch
        if pre is not None and pre[2] is not None:
            self._prefetch = pre = None
        bounds = sp.bounds
        # rows change somewhere (known here unless an admission filter drops gradients)
        live = int(u - (bad.sum() if self.nan_policy == "skip" else 0))
        tick = live > 0 and not self._admission

        def args(s: int) -> tuple:
            lo, hi = bounds[s], bounds[s + 1]
            return uniq[lo:hi], sums[lo:hi], None if step is None else int(step), tick

        ev = self._eviction
        # (an admission filter or an eviction schedule needs the answers before going on)
        wait = not (self.mode == "async" and not self._admission and
                    not (ev is not None and ev.every_n_steps))
        sent = self._send_all("push", args, True)
        if isinstance(sent, Op) and wait:
            sent.run()  # committed: what is read next sees it
        if pre is not None and (wait or not isinstance(sent, Op)):
            # the next batch's rows, read right behind this update
            self._prefetch = (pre[0], pre[1], self._send_pull(pre[1], False, "peek"),
                              sum(self.channel.seq))
        if not wait:
            self._inflight.append(sent)
            self._advance(block=False)
            if len(self._inflight) > self.staleness:
                self._advance(block=True)
                while len(self._inflight) > self.staleness:
                    self._gather(self._inflight.popleft())
            return int(u)
        seq0 = self._seq
        res = self._gather(sent)
        new_step = int(res[0][1])
        if ev is not None and ev.every_n_steps and new_step % ev.every_n_steps == 0:
            # the shards evicted by their own rules in the same call; max_rows ranks them all
            evicted_already = self._seq - seq0 > 1
            extra = self._evict_global(fold=True)
            if evicted_already:
                self._seq -= extra
        return int(sum(r[0] for r in res))

    def upsert(self, keys: Any, values: Any) -> int:
        """Set the values of ``keys`` (see ``EmbeddingTable.upsert``); rows written."""
        k = self.as_keys(keys)
        v = np.asarray(values)
        if v.dtype.kind != "f" or v.shape != (k.shape[0], self.dim):
            raise ShapeError(
                f"values have shape {v.shape} and dtype {v.dtype}; {k.shape[0]} keys need a "
                f"float array of shape ({k.shape[0]}, {self.dim})")
        if self.nan_policy == "raise":
            bad = nonfinite_rows(v, None, _storage_np_dtype(self.dtype))
            if np.any(bad):
                pos = np.flatnonzero(bad)
                raise NonFiniteValueError(
                    f"upsert: {pos.size} rows hold NaN or Inf or values beyond the "
                    f"{self.dtype} range (keys {k[pos][:8].tolist()}); nothing was written. "
                    "Fix the values, or create the table with nan_policy='skip'")
        self._mutating()
        order, bounds = self._by_shard(k)

        def args(s: int) -> tuple:
            p = order[bounds[s]:bounds[s + 1]]
            return "upsert", (k[p], v[p])

        return int(sum(self._gather(self._send_all("call", args, True))))

    def remove(self, keys: Any) -> int:
        """Remove keys (absent ones ignored); how many rows were removed."""
        k = self.as_keys(keys)
        self._mutating()
        order, bounds = self._by_shard(k)
        shards = [s for s in range(self.num_shards) if bounds[s + 1] > bounds[s]]

        def args(s: int) -> tuple:
            return "remove", (k[order[bounds[s]:bounds[s + 1]]],)

        return int(sum(self._gather(self._send_all("call", args, True, shards))))

    def clear(self) -> None:
        """Remove every row (and the admission filters' counts)."""
        self._mutating()
        self._call("clear", mutating=True)

    def evict(self) -> int:
        """Apply the eviction policy now (``max_rows`` ranks the rows of all shards)."""
        self._mutating()
        seq0 = self._seq
        n = int(sum(self._call("evict", mutating=True)))
        grew = self._seq - seq0
        extra = self._evict_global()
        if grew and extra:
            self._seq -= 1  # one eviction: the reference counts it once
        return n + extra

    def _evict_global(self, fold: bool = False) -> int:
        """The ``max_rows`` part of eviction, over every shard's rows; rows evicted.

        Each shard sends its lowest-ranked rows (as many as must go in all), the client
        merges them in the order the single-process table ranks rows, and each shard removes
        its part. With ``fold`` the result is the ``mutation_seq`` to take back (the
        reference counts the update and its eviction as two changes, not three).
        """
        ev = self._eviction
        if ev is None or ev.max_rows is None:
            return 0
        total = int(sum(self._call("len")))
        n_evict = total - int(ev.max_rows)
        if n_evict <= 0:
            return 0
        cands = self._call("eviction_candidates", n_evict, ev.policy)
        keys = np.concatenate([c[0] for c in cands])
        freq = np.concatenate([c[1] for c in cands])
        ver = np.concatenate([c[2] for c in cands])
        order = np.lexsort((keys, ver, freq) if ev.policy == "lfu" else (keys, freq, ver))
        gone = keys[order[:n_evict]]
        seq0 = self._seq
        o, b = self._by_shard(gone)
        shards = [s for s in range(self.num_shards) if b[s + 1] > b[s]]
        n = int(sum(self._gather(self._send_all(
            "call", lambda s: ("evict_keys", (gone[o[b[s]:b[s + 1]]],)), True, shards))))
        return (self._seq - seq0) if fold else n

    @property
    def step(self) -> int:
        """The table's step (every shard counts every ``apply_gradients``)."""
        self._mutating()
        return int(self._call("step", shards=[0])[0])

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(f"step={value!r} must be a non-negative integer")
        self._mutating()
        self._call("set_step", int(value), mutating=True)

    def load_state_meta(self, meta: dict[str, Any]) -> None:
        """Restore the table-global state of a checkpoint (optimizer state, step)."""
        self._mutating()
        self._call("load_state_meta", meta, mutating=True)

    def reserve(self, n_keys: int) -> None:
        """Nothing to do: each shard grows its own rows."""

    # --- reads -------------------------------------------------------------------------------
    def _read(self, method: str, keys: Any, dtype: Any) -> np.ndarray:
        k = self.as_keys(keys)
        self._mutating()
        order, bounds = self._by_shard(k)
        shards = [s for s in range(self.num_shards) if bounds[s + 1] > bounds[s]]
        out = np.empty(k.shape[0], dtype)
        sent = self._send_all(
            "call", lambda s: (method, (k[order[bounds[s]:bounds[s + 1]]],)), False, shards)
        for s, res in zip(shards, self._gather(sent), strict=True):
            out[order[bounds[s]:bounds[s + 1]]] = res
        return out

    def contains(self, keys: Any) -> np.ndarray:
        """Whether each key has a row."""
        return self._read("contains", keys, np.bool_)

    def __contains__(self, key: Any) -> bool:
        return bool(self.contains([key])[0])

    def frequency(self, keys: Any) -> np.ndarray:
        """Lookup count of each key (0 for keys without a row)."""
        return self._read("frequency", keys, np.int64)

    def version(self, keys: Any) -> np.ndarray:
        """Last-update step of each key (-1 for keys without a row)."""
        return self._read("version", keys, np.int64)

    def __len__(self) -> int:
        self._mutating()
        return int(sum(self._call("len")))

    def keys(self) -> np.ndarray:
        """All keys with a row (int64; shard by shard)."""
        self._mutating()
        parts = self._call("keys")
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def rebase(self) -> None:
        """Count on from the shards' counters as they are (after a reshard or a load)."""
        self._seq_map = SeqMap(self.num_shards)
        self._own_seq = 0
        self._seq += 1
        self._seq_base = sum(self._shard_seqs())

    def _shard_seqs(self) -> list[int]:
        return [int(x) for x in self._call("mutation_seq")]

    @property
    def mutation_seq(self) -> int:
        """Counter of changes: as the single-process table counts them, for one client.

        Changes made by other clients add what they added to the shards' counters.
        """
        self._mutating()
        return self._seq + (sum(self._shard_seqs()) - self._seq_base - self._own_seq)

    def stats(self) -> dict[str, Any]:
        """The shards' ``stats()`` summed (``step`` from shard 0), and ``shards``: each one's."""
        self._mutating()
        per = self._call("stats")
        out: dict[str, Any] = {}
        for name in ("rows", "capacity", "index_slots", "bytes", "hits", "misses", "inserts",
                     "collisions", "evictions", "admissions_rejected", "gradients_dropped",
                     "nonfinite_skipped", "removed", "mutation_seq"):
            out[name] = sum(int(p.get(name, 0)) for p in per)
        out["collisions"] += self._collisions
        out["step"] = per[0]["step"]
        out["row_bytes"] = per[0]["row_bytes"]
        out["load_factor"] = out["rows"] / max(out["index_slots"], 1)
        out["bytes_per_key"] = out["bytes"] / out["rows"] if out["rows"] else float("nan")
        out["num_shards"] = self.num_shards
        out["shards"] = per
        return out

    # --- export / import ----------------------------------------------------------------------
    def state_dict_meta(self) -> dict[str, Any]:
        """Shard 0's description of the table (``mutation_seq``: the sum over shards)."""
        meta = dict(self._call("state_dict_meta", shards=[0])[0])
        meta["mutation_seq"] = self.mutation_seq
        return meta

    def export(self, chunk_rows: int = 65536, since: int | None = None) -> Any:
        """Yield every shard's rows in chunks (see ``EmbeddingTable.export``).

        ``since``: a :attr:`mutation_seq` value; the rows changed after it. The rows' ``seq``
        are given on the scale of :attr:`mutation_seq`.
        """
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or \
                chunk_rows < 1:
            raise ConfigError(f"chunk_rows={chunk_rows!r} must be a positive int")
        self._mutating()
        m = self._seq_map
        sent = self._send_all(
            "call", lambda s: ("export", (int(chunk_rows),
                                          None if since is None else m.shard_seq(s, since))),
            False)
        for s, chunks in enumerate(self._gather(sent)):
            for c in chunks:
                f = [np.array(x) for x in c]
                f[5] = m.global_seq(s, f[5])
                yield ExportChunk(*f)

    def import_(self, chunks: Any) -> int:
        """Import exported rows (see ``EmbeddingTable.import_``), each to its shard."""
        if is_single_chunk(chunks):
            chunks = [chunks]
        self._mutating()
        total = 0
        for c in chunks:
            fields = tuple(np.asarray(f) for f in c)
            k = self.as_keys(fields[0])
            order, bounds = self._by_shard(k)
            shards = [s for s in range(self.num_shards) if bounds[s + 1] > bounds[s]]

            def args(s: int, fields: tuple = fields, order: Any = order,
                     bounds: Any = bounds) -> tuple:
                p = order[bounds[s]:bounds[s + 1]]
                return "import_", ([tuple(f[p] for f in fields)],)

            total += sum(int(x or 0) for x in self._gather(
                self._send_all("call", args, True, shards)))
        return total

    # --- checkpoints --------------------------------------------------------------------------
    def save_sharded(self, url: str, tag: str, **options: Any) -> str:
        """Save the table as a sharded checkpoint: every shard writes its own rows at once.

        ``tensorkv.save(table, url, tag, ...)`` calls this. The tag holds one table, under
        this table's name; ``options`` are :func:`tensorkv.save` arguments (``step``,
        ``incremental``, ``parent``, ``metadata``, ``ttl``). The shards are saved at one
        agreed state behind a save barrier (see ``ParameterServer.save``).
        """
        self._mutating()
        metadata = options.pop("metadata", None)
        # every shard at one agreed state, whatever other workers push meanwhile
        save_barrier(self.channel, lambda a, token: a.save_shard.remote(
            url, tag, [self.name], metadata, options, thaw=token))
        return tag

    def load_sharded(self, url: str, tag: str = "latest") -> None:
        """Replace the rows with those of a checkpoint (saved from any number of shards).

        ``tensorkv.load(table, url, tag)`` calls this: each shard reads only its own keys.
        The tag must hold one table (any name), or one named as this table.
        """
        from tensorkv.checkpoint import tag_manifest

        ray = ray_module()
        self._mutating()
        tag = resolve_tag(url, tag)
        names = sorted(tag_manifest(url, tag)["tables"])
        saved = self.name if self.name in names else names[0] if len(names) == 1 else None
        if saved is None:
            raise ConfigError(f"tag {tag!r} holds tables {names}; load one of them with "
                              f"tensorkv.load({{name: table}}, url, tag)")
        ray.get([a.load_shard.remote(url, tag, [self.name], saved)
                 for a in self.channel.actors])
        self.rebase()

    # --- lifecycle ----------------------------------------------------------------------------
    def wait_writes(self) -> None:
        """Wait for updates in flight and every shard's background writes."""
        self._mutating()
        self._call("wait_writes")

    def flush(self) -> None:
        """:meth:`wait_writes`, then flush every shard's lower tiers."""
        self._mutating()
        self._call("flush")

    def close(self) -> None:
        """Wait for this client's updates in flight (the table stays on the shards)."""
        self._mutating()

    def __enter__(self) -> ShardedEmbeddingTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardedEmbeddingTable(name={self.name!r}, dim={self.dim}, "
                f"shards={self.num_shards}, mode={self.mode!r})")


def _storage_np_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        from tensorkv.errors import import_optional

        return np.dtype(import_optional("ml_dtypes", "bfloat16 rows", "all").bfloat16)
    return np.dtype(np.float16 if dtype == "float16" else np.float32)


__all__ = ["SeqMap", "ShardedEmbeddingTable", "resolve_tag", "Split"]
