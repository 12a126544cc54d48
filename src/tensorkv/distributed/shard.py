"""One shard of a parameter server: the tables' rows of one hash range, behind a Ray actor.

:class:`ShardServer` is a plain class; :mod:`tensorkv.distributed.server` turns it into a Ray
actor. Each shard holds one :class:`~tensorkv.EmbeddingTable` per table name (with its own
storage chain) and keeps, per client (``worker``), the sequence number of the last mutating
request it applied: a request whose number it has seen is a retry and is not applied again
(exactly once), and a request that skips numbers finds the shard behind (it was restarted
from a checkpoint) and is answered with :data:`BEHIND`, so the client replays what the shard
lost first. The shard checkpoints its tables (values, optimizer slots, frequencies, versions)
and the applied sequence numbers into ``checkpoint_url`` every ``checkpoint_every`` mutating
requests, incrementally, and a restarted shard reloads its newest checkpoint.

A change that spans several shards arrives in two phases (:mod:`tensorkv.distributed.ops`):
:meth:`ShardServer.stage` keeps the shard's part, :meth:`ShardServer.commit` applies it
(:meth:`ShardServer.abort` drops it). While a save takes its snapshot (:meth:`ShardServer.freeze`)
the shard refuses new parts and changes (:data:`REFUSED`); the client retries them afterwards.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import uuid
from typing import Any

import numpy as np

from tensorkv.distributed import shm, wire
from tensorkv.distributed.ops import (
    ABORTED,
    COMMITTED,
    NONE,
    UNKNOWN,
    Janitor,
    Ledger,
    Part,
    shard_actor_name,
)
from tensorkv.distributed.shard_store import ShardStore, checkpoint_prefix, dumps
from tensorkv.distributed.wire import BEHIND, REFUSED, REREAD, STAGED
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import ConfigError, ReshardedError, ShardUnavailableError

#: Methods of the table a client may call through :meth:`ShardServer.call`, and whether each
#: changes the table (mutating calls carry a sequence number and are applied exactly once).
TABLE_METHODS: dict[str, bool] = {
    "upsert": True, "remove": True, "evict_keys": True, "clear": True, "evict": True,
    "import_": True, "set_step": True, "load_state_meta": True, "optimizer_tick": True,
    "contains": False, "frequency": False, "version": False, "keys": False, "len": False,
    "stats": False, "state_dict_meta": False, "mutation_seq": False, "step": False,
    "export": False, "wait_writes": False, "flush": False, "eviction_candidates": False,
}


def _in_ray_actor() -> bool:
    """Whether this process runs a Ray actor (a shard made by a ParameterServer)."""
    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized()
                    and ray.get_runtime_context().get_actor_id())
    except Exception:
        return False


class ShardServer(ShardStore):
    """The tables of one shard and their exactly-once, checkpointed updates.

    Parameters
    ----------
    ps_name
        Name of the parameter server (tags of its checkpoints start with it).
    index, num_shards
        This shard, of how many: it holds the keys ``shard_of_keys(key, num_shards) == index``.
    generation
        Generation of the shard set (``reshard`` starts a new one).
    checkpoint_url
        Store of the periodic checkpoints, or None (no checkpoints: a restarted shard is empty
        and its clients raise :class:`~tensorkv.errors.ShardUnavailableError`).
    checkpoint_every
        Mutating requests between two periodic checkpoints (0: only on request).
    init_from
        ``(url, tag)`` of a checkpoint to load this shard's rows from at the first start (the
        shard's own checkpoints take precedence after a restart).
    full_every
        Every this many checkpoints one is a full save, after which the shard deletes its
        older checkpoint tags (so at most this many are kept).
    resolve_after
        Seconds a part of an operation over several shards may stay staged before this
        shard's janitor has the operation finished or undone (:mod:`tensorkv.distributed.ops`;
        only in a Ray actor).
    """

    def __init__(self, ps_name: str, index: int, num_shards: int, generation: int = 0,
                 checkpoint_url: str | None = None, checkpoint_every: int = 100,
                 init_from: tuple[str, str] | None = None, full_every: int = 20,
                 resolve_after: float = 2.0) -> None:
        # the table's parallel kernels wait for work asleep, not spinning: several shards
        # (and their clients) share the node's cores (read when the thread pool starts)
        os.environ.setdefault("OMP_WAIT_POLICY", "passive")
        self.ps_name = ps_name
        self.index = int(index)
        self.num_shards = int(num_shards)
        self.generation = int(generation)
        self.url = checkpoint_url
        self.every = int(checkpoint_every)
        self.prefix = checkpoint_prefix(ps_name, generation, index)
        self.tables: dict[str, EmbeddingTable] = {}
        self.specs: dict[str, dict[str, Any]] = {}
        self.applied: dict[str, int] = {}  # worker -> last mutating sequence number applied
        self.ckpt_applied: dict[str, int] = {}  # the same, as of the newest checkpoint
        self.ckpt_version = 0
        self.ckpt_tag: str | None = None
        self.full_every = max(1, int(full_every))
        self.since_full = 0
        self.since_ckpt = 0
        self.requests = 0
        self.peeked: dict[str, list[int]] = {}  # table -> [hits, misses] counted by peeks
        self.evicted: dict[str, int] = {}  # table -> rows removed by max_rows evictions
        self.started = time.time()
        self.mapped = shm.Mapped()  # clients' shared-memory buffers
        self.restored_from: str | None = None
        self.ledger = Ledger()
        self.retired: tuple[int, int] | None = None  # (generation, shards) after a reshard
        self.replaying = False  # serving a client's replay (accepted once: never refused)
        self.janitor: Janitor | None = None
        if _in_ray_actor():
            self.janitor = Janitor(self.ledger, self.index, self._names, resolve_after)
            self.janitor.start()
        if self.url is not None and self._recover():
            return
        if init_from is not None:
            self._load_from(*init_from)
            if self.url is not None:
                self.checkpoint()

    def _names(self) -> list[str]:
        return [shard_actor_name(self.ps_name, self.generation, i)
                for i in range(self.num_shards)]

    # --- identity --------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Shard number, generation, pid, tables, the checkpoint it restored from."""
        return {"index": self.index, "num_shards": self.num_shards, "pid": os.getpid(),
                "generation": self.generation, "tables": sorted(self.tables),
                "restored_from": self.restored_from, "checkpoint": self.ckpt_tag,
                "checkpoint_url": self.url, "retired": self.retired}

    def applied_seq(self, worker: str) -> tuple[int, int]:
        """``(last applied, last checkpointed)`` sequence numbers of ``worker``."""
        self._check_retired()
        return self.applied.get(worker, 0), self.ckpt_applied.get(worker, 0)

    def register(self, worker: str, lease: list[Any]) -> bool:
        """Keep ``worker``'s lease (``[object ref]``): the janitor asks it whether it lives."""
        if lease:
            self.ledger.leases[worker] = lease[0]
        return True

    # --- tables ----------------------------------------------------------------------------
    def _build(self, name: str, spec: dict[str, Any]) -> EmbeddingTable:
        # a copy of its own: arrays arrive read-only from the object store, and filters or
        # optimizers keep state in theirs
        kw = copy.deepcopy(spec)
        path = kw.get("storage_path")
        if isinstance(path, str) and "://" not in path:
            # every shard (and every start of one) spills into a directory of its own
            kw["storage_path"] = os.path.join(
                path, f"{self.ps_name}-{name}-s{self.index}-{uuid.uuid4().hex[:8]}")
        dim = kw.pop("dim")
        ev = Eviction.from_config(kw.get("eviction"))
        if ev is not None and ev.max_rows is not None:
            # max_rows ranks the rows of every shard: the client runs that part
            # (ShardedEmbeddingTable.evict); the shard keeps the row-by-row rules
            kw["eviction"] = Eviction(steps_to_live=ev.steps_to_live,
                                      l2_threshold=ev.l2_threshold, policy=ev.policy,
                                      every_n_steps=ev.every_n_steps)
        return EmbeddingTable(dim, **kw)

    def create(self, name: str, spec: dict[str, Any] | None) -> dict[str, Any]:
        """Create table ``name`` from ``spec`` (EmbeddingTable arguments), or find it.

        Returns its ``dim``, whether it was created now and its arguments (pickled). A table
        that exists keeps its arguments; the client compares them.
        """
        self._check_retired()
        self.requests += 1
        created = name not in self.tables
        if created and spec is None:
            raise ConfigError(f"parameter server {self.ps_name!r} has no table {name!r}")
        if created:
            assert spec is not None
            self.tables[name] = self._build(name, spec)
            self.specs[name] = dict(spec)
            if self.url is not None:
                self.checkpoint()  # a restarted shard must know the table
        return {"dim": self.tables[name].dim, "created": created,
                "spec": dumps(self.specs[name])}

    def drop(self, name: str) -> bool:
        """Remove table ``name`` (closing its storage); whether it existed."""
        self.requests += 1
        t = self.tables.pop(name, None)
        self.specs.pop(name, None)
        if t is None:
            return False
        t.close()
        if self.url is not None:
            self.checkpoint()
        return True

    def _table(self, name: str) -> EmbeddingTable:
        t = self.tables.get(name)
        if t is None:
            raise ConfigError(
                f"parameter server {self.ps_name!r} has no table {name!r} (shard {self.index}); "
                f"create it with ps.table({name!r}, dim=...); tables: {sorted(self.tables)}")
        return t

    # --- exactly once ----------------------------------------------------------------------
    def _check_retired(self) -> None:
        if self.retired is not None:
            gen, n = self.retired
            raise ReshardedError(
                f"parameter server {self.ps_name!r} was resharded to {n} shards (generation "
                f"{gen}) after this client attached; this client still addresses the "
                f"{self.num_shards} shards of generation {self.generation}. Attach again with "
                f"ParameterServer(name={self.ps_name!r}) and take its tables from there "
                "(ps.table(name))")

    def _admit(self, worker: str, seq: int, mutating: bool, freezable: bool = True) -> str:
        """``"apply"``, ``"dup"`` (a retry), :data:`BEHIND` or :data:`REFUSED`.

        :data:`REFUSED`: a change while a save barrier holds, recorded as done, not applied.
        """
        self._check_retired()
        self.requests += 1
        last = self.applied.get(worker, 0)
        if not mutating:
            return "apply" if seq <= last else BEHIND
        if seq <= last:
            return "dup"
        if seq != last + 1:
            return BEHIND
        self.ledger.synced.add(worker)
        if freezable and self.ledger.freezes and not self.replaying:
            self._done(worker, seq)
            return REFUSED
        return "apply"

    def _done(self, worker: str, seq: int) -> int:
        """Record request ``seq`` of ``worker`` as applied; checkpoint when due.

        Returns the worker's sequence number in the newest checkpoint (the client drops its
        log up to it).
        """
        self.applied[worker] = seq
        self.since_ckpt += 1
        if self.url is not None and self.every and self.since_ckpt >= self.every:
            self.checkpoint()
        return self.ckpt_applied.get(worker, 0)

    def replay(self, method: str, *args: Any) -> Any:
        """``method(*args)`` of a request a client sends again after this shard restarted.

        The shard accepted it before it lost it, so a save barrier does not refuse it now.
        """
        self.replaying = True
        try:
            return getattr(self, method)(*args)
        finally:
            self.replaying = False

    def noop(self, name: str, worker: str, seq: int) -> Any:
        """Nothing, under sequence number ``seq`` (what a refused change is replayed as)."""
        state = self._admit(worker, seq, True, freezable=False)
        if state == BEHIND:
            return BEHIND
        ck = self._done(worker, seq) if state == "apply" else self.ckpt_applied.get(worker, 0)
        return None, ck, 0, 0

    # --- the data path: what each request does ---------------------------------------------
    def _pull_core(self, name: str, keys_counts: np.ndarray, insert: bool, touch: bool,
                   out: np.ndarray | None) -> tuple[Any, int, int]:
        """The lookup of a pull that inserts; ``(rows, delta, seq)`` (see :meth:`pull`)."""
        keys, counts = keys_counts[0], keys_counts[1]
        t = self._table(name)
        before = t.mutation_seq
        absent = ~t.contains(keys) if touch else None
        rows = self._lookup(t, keys, counts, insert, out)
        after = t.mutation_seq
        if absent is not None and rows.shape[0] == keys.shape[0]:
            return (absent, rows[absent]), after - before, after
        return rows, after - before, after

    def _push_core(self, name: str, keys: np.ndarray, grads: np.ndarray, step: int | None,
                   tick: bool, decided: bool = False) -> tuple[Any, int, int]:
        """Apply summed gradients; ``((rows, step), delta, seq)``.

        ``tick``: count the optimizer's step even if no row here changes. ``decided``: the
        push is part of an operation over several shards, whose shards all count the step or
        none does, by ``tick`` alone.
        """
        t = self._table(name)
        before, opt_step = t.mutation_seq, t.optimizer.step
        n = t.apply_gradients(keys, grads, step=step, unique=True)  # distinct keys
        if decided:
            if t.optimizer.step != opt_step + int(tick):
                self._set_opt_step(t, opt_step + int(tick))
        elif n == 0 and tick:
            self._set_opt_step(t, opt_step + 1)
        after = t.mutation_seq
        return (n, t.step), after - before, after

    def _call_core(self, name: str, method: str, args: tuple) -> tuple[Any, int, int]:
        t = self._table(name)
        before = t.mutation_seq
        out = self._run(t, method, args)
        if method == "stats":
            peeked = self.peeked.get(name, [0, 0])
            out["hits"] -= peeked[0]
            out["misses"] -= peeked[1]
            evicted = self.evicted.get(name, 0)
            out["evictions"] += evicted
            out["removed"] -= evicted
        elif method == "evict_keys":
            self.evicted[name] = self.evicted.get(name, 0) + out
        after = t.mutation_seq
        return out, after - before, after

    # --- the data path: requests applied at once -------------------------------------------
    def pull(self, name: str, worker: str, seq: int, keys_counts: np.ndarray,
             insert: bool, touch: bool = False, out: np.ndarray | None = None) -> Any:
        """Rows of distinct keys, each seen some times (a lookup of every sighting).

        ``keys_counts`` is int64 ``[2, n]``: the keys, and how often each was seen (one
        array: each array argument of a Ray call costs its own serialisation).

        Returns ``(rows, ckpt_seq, seq_delta, seq)`` (``seq_delta``: how much the table's
        ``mutation_seq`` grew, to ``seq``): ``rows`` is ``[len(keys), dim]``, or ``[counts.sum(),
        dim]`` (one row per sighting, grouped by key) in the rare case where sightings of one
        key read differently (an admission filter admitting a key mid-batch, with a
        ``default_value``); or :data:`BEHIND` (or :data:`REFUSED`). With ``touch`` (the
        lookup of keys a :meth:`peek` read already) ``rows`` is ``(absent, rows[absent])``:
        only the rows of keys that had no row before, unless the rows are per sighting.
        ``out``: where to write rows per key (``[len(keys), dim]`` float32; rows per
        sighting go elsewhere).
        """
        state = self._admit(worker, seq, insert)
        if state in (BEHIND, REFUSED):
            return state
        if state == "dup" or not insert:
            t = self._table(name)
            rows = self._lookup(t, keys_counts[0], keys_counts[1], False, out)
            return rows, (self.ckpt_applied.get(worker, 0) if insert else 0), 0, 0
        try:
            value, delta, after = self._pull_core(name, keys_counts, True, touch, out)
        finally:
            ck = self._done(worker, seq)
        return value, ck, delta, after

    def peek(self, name: str, worker: str, seq: int, keys_counts: np.ndarray) -> Any:
        """Rows of ``keys`` as a lookup would return them now, changing nothing.

        The read counts in no counter (the hits and misses the table counts for it are taken
        off what :meth:`call` ``("stats")`` reports), so a prefetch whose lookup never comes
        leaves no trace. Returns ``(rows, 0, 0, 0)`` or :data:`BEHIND`.
        """
        if self._admit(worker, seq, False) == BEHIND:
            return BEHIND
        keys, counts = keys_counts[0], keys_counts[1]
        t = self._table(name)
        found = t.contains(keys)
        hits = int(counts[found].sum())
        rows = self._lookup(t, keys, counts, False)
        peeked = self.peeked.setdefault(name, [0, 0])
        peeked[0] += hits
        peeked[1] += int(counts.sum()) - hits
        return rows, 0, 0, 0

    def pull_shm(self, name: str, worker: str, seq: int, request: tuple, reply: tuple,
                 insert: bool) -> Any:
        """:meth:`pull` of keys and counts in a client's shared-memory buffer.

        ``request``, ``reply``: descriptors (:func:`tensorkv.distributed.shm.descriptor`) of
        the ``[2, n]`` keys and counts, and of ``[counts.sum(), dim]`` float32 room for the
        rows. Rows per key are written to its start and answered as
        :class:`~tensorkv.distributed.shm.Rows`; rows per sighting come back as an array.
        :data:`~tensorkv.distributed.shm.NO_SHM` if the buffers cannot be mapped here
        (nothing was done).
        """
        try:
            kc, out = self.mapped.array(request), self.mapped.array(reply)
        except OSError:
            return shm.NO_SHM
        return self._rows_in(self.pull(name, worker, seq, kc, insert, out=out), out,
                             kc.shape[1])

    def push_shm(self, name: str, worker: str, seq: int, keys: tuple, grads: tuple,
                 step: int | None, tick: bool = False) -> Any:
        """:meth:`push` of keys and gradients in a client's shared-memory buffer.

        ``keys``, ``grads``: their descriptors. :data:`~tensorkv.distributed.shm.NO_SHM` if
        the buffer cannot be mapped here (nothing was done).
        """
        try:
            k, g = self.mapped.array(keys), self.mapped.array(grads)
        except OSError:
            return shm.NO_SHM
        return self.push(name, worker, seq, k, g, step, tick)

    @staticmethod
    def _rows_in(res: Any, out: np.ndarray, u: int) -> Any:
        """An answer whose rows per key lie at the start of ``out``: they stay there."""
        if isinstance(res, str) or not _starts(res[0], out, u):
            return res
        return (shm.Rows(*res[0].shape), *res[1:])

    @staticmethod
    def _lookup(t: EmbeddingTable, keys: np.ndarray, counts: np.ndarray,
                insert: bool, out: np.ndarray | None = None) -> np.ndarray:
        """Look every sighting up (counters and admission see them all); rows per key.

        ``out``: room for the rows; rows per key are written to its start (and a view of it
        returned). With room for every sighting, no row is copied twice.
        """
        u = keys.shape[0]
        if not (counts.size and int(counts.max()) > 1):
            return t.lookup(keys, insert=insert, out=None if out is None else out[:u])
        n = int(counts.sum())
        if t.admission is None:
            # each key once (first sightings in order: the same rows are inserted, in the
            # same order), then the further sightings: one lookup that counts them all, and
            # the rows per key are its first rows
            dup = np.flatnonzero(counts > 1)
            both = np.concatenate([keys, np.repeat(keys[dup], counts[dup] - 1)])
            room = out if out is not None and out.shape[0] >= n else \
                np.empty((n, t.dim), np.float32)
            t.lookup(both, insert=insert, out=room[:n])
            if out is None:
                return room[:u]
            if room is not out:
                out[:u] = room[:u]
            return out[:u]
        every = t.lookup(np.repeat(keys, counts), insert=insert)
        first = np.zeros(keys.shape[0], np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        rows = np.take(every, first, axis=0, out=None if out is None else out[:u])
        # sightings of one key read alike unless an admission filter admits it mid-batch
        # and a default_value differs from its initial value: compare only then
        if insert:
            dup = np.flatnonzero(counts > 1)
            idx = np.repeat(np.arange(keys.shape[0]), counts)
            multi = np.isin(idx, dup)
            if not np.array_equal(every[multi], rows[idx[multi]]):
                return every
        return rows

    def push(self, name: str, worker: str, seq: int, keys: np.ndarray, grads: np.ndarray,
             step: int | None, tick: bool = False) -> Any:
        """Apply summed gradients of distinct keys; ``((rows, step), ckpt, delta, seq)``.

        ``tick``: other shards update rows in this step, so the optimizer counts the step
        even if no row of this shard changes (as the single-process table counts it once).
        """
        state = self._admit(worker, seq, True)
        if state in (BEHIND, REFUSED):
            return state
        if state == "dup":
            t = self._table(name)
            return (0, t.step), self.ckpt_applied.get(worker, 0), 0, 0
        try:
            value, delta, after = self._push_core(name, keys, grads, step, tick)
        finally:
            ck = self._done(worker, seq)
        return value, ck, delta, after

    def frame(self, data: bytes) -> bytes:
        """A ``pull``, ``peek`` or ``push`` request packed as one frame; the answer packed.

        See :mod:`tensorkv.distributed.wire` (small requests travel so); a frame with an
        operation number is a staged part (:meth:`stage`).
        """
        method, name, worker, seq, args, op, parts = wire.unpack_request(data)
        if op:
            return wire.pack_reply(self._stage(name, worker, seq, op, parts, method, args,
                                               framed=True))
        return wire.pack_reply(getattr(self, method)(name, worker, seq, *args))

    def call(self, name: str, worker: str, seq: int, method: str, args: tuple) -> Any:
        """Any other table method (:data:`TABLE_METHODS`); ``(result, ckpt, delta, seq)``."""
        mutating = self._method(method)
        state = self._admit(worker, seq, mutating)
        if state in (BEHIND, REFUSED):
            return state
        if state == "dup":
            return None, self.ckpt_applied.get(worker, 0), 0, 0
        try:
            out, delta, after = self._call_core(name, method, args)
        finally:
            ck = self._done(worker, seq) if mutating else 0
        return out, ck, delta, after

    @staticmethod
    def _method(method: str) -> bool:
        mutating = TABLE_METHODS.get(method)
        if mutating is None:
            raise ConfigError(f"{method!r} is not a table method a shard serves; use one of "
                              f"{sorted(TABLE_METHODS)}")
        return mutating

    @staticmethod
    def _set_opt_step(t: EmbeddingTable, step: int) -> None:
        """Set the optimizer's global step (an update elsewhere counts one without rows)."""
        state = dict(t.optimizer.state())
        state["step"] = int(step)
        t.optimizer.load_state(state)

    @staticmethod
    def _tick(t: EmbeddingTable) -> None:
        """Count one optimizer step without rows (what an update elsewhere counts)."""
        ShardServer._set_opt_step(t, int(t.optimizer.step) + 1)

    def _run(self, t: EmbeddingTable, method: str, args: tuple) -> Any:
        if method == "len":
            return len(t)
        if method == "set_step":
            t.step = args[0]
            return None
        if method in ("mutation_seq", "step"):
            return getattr(t, method)
        if method == "export":
            return list(t.export(*args))
        if method == "optimizer_tick":
            self._tick(t)
            return None
        if method == "evict_keys":
            return t.remove(args[0])
        if method == "eviction_candidates":
            n, policy = args
            keys = t.keys()
            freq, ver = t.frequency(keys), t.version(keys)
            order = np.lexsort((keys, ver, freq) if policy == "lfu" else (keys, freq, ver))[:n]
            return keys[order], freq[order], ver[order]
        if method == "load_state_meta":
            meta = args[0]
            opt_state = (meta.get("optimizer") or {}).get("state")
            if opt_state is not None:
                t.optimizer.load_state(opt_state)
            if "step" in meta:
                t.step = int(meta["step"])
            return None
        return getattr(t, method)(*args)

    # --- operations over several shards (tensorkv.distributed.ops) -------------------------
    def stage(self, name: str, worker: str, seq: int, op: int, parts: tuple[int, ...],
              method: str, *args: Any) -> Any:
        """Keep this shard's part of operation ``op`` of ``worker`` until it is decided.

        ``method`` and ``args``: the request the part would be (``pull``, ``push``, or
        ``call`` with the table method and its arguments); ``parts``: the operation's
        shards. Returns ``((STAGED, would), ckpt, 0, 0)`` (``would``: a push that would
        change rows here), :data:`REFUSED` (a save barrier holds, or the operation was
        undone already: abort it and run it again) or :data:`BEHIND`.
        """
        return self._stage(name, worker, seq, op, tuple(parts), method, args)

    def stage_shm(self, name: str, worker: str, seq: int, op: int, parts: tuple[int, ...],
                  method: str, *args: Any) -> Any:
        """:meth:`stage` of a ``pull`` or ``push`` in a client's shared-memory buffers.

        ``args``: those of :meth:`pull_shm` or :meth:`push_shm` after the sequence number;
        the part keeps views of the buffers (the client leaves them alone until the commit).
        """
        try:
            if method == "pull":
                request, reply, insert = args
                kc, out = self.mapped.array(request), self.mapped.array(reply)
                real: tuple = (kc, insert, False, out)
            else:
                keys, grads, step, tick = args
                real = (self.mapped.array(keys), self.mapped.array(grads), step, tick)
        except OSError:
            return shm.NO_SHM
        return self._stage(name, worker, seq, op, tuple(parts), method, real)

    def _stage(self, name: str, worker: str, seq: int, op: int, parts: tuple[int, ...],
               method: str, args: tuple, framed: bool = False) -> Any:
        state = self._admit(worker, seq, True)
        if state == BEHIND:
            return BEHIND
        if state == REFUSED:
            self.ledger.record(worker, op, 0)
            return REFUSED
        st, _ = self.ledger.status(worker, op)
        ck = self.ckpt_applied.get(worker, 0)
        if state == "dup":  # a request sent again: answer what became of it
            return ((STAGED, False), ck, 0, 0) if st in (STAGED, COMMITTED) else REFUSED
        if op <= self.ledger.floor.get(worker, 0):
            self._done(worker, seq)
            raise ShardUnavailableError(
                f"operation {op} of client {worker!r} is older than the outcomes shard "
                f"{self.index} keeps; it cannot tell whether it was applied")
        if st == STAGED:  # (kept across a lost answer)
            return (STAGED, self.ledger.staged[(worker, op)].would), self._done(worker, seq), 0, 0
        if st not in (NONE, UNKNOWN):  # undone by a resolution already
            self._done(worker, seq)
            return REFUSED
        try:
            t = self._table(name)
            if method == "call":
                if not self._method(args[0]):
                    raise ConfigError(f"{args[0]!r} changes nothing: it is not staged")
            elif method not in ("pull", "push"):
                raise ConfigError(f"{method!r} cannot be staged; stage pull, push or call")
            would = False
            if method == "push" and t.admission is not None:
                keys, grads = args[0], args[1]
                live = np.isfinite(grads).all(axis=1) if grads.size else np.zeros(0, bool)
                would = bool(t.contains(keys[live]).any()) if live.any() else False
            self.ledger.staged[(worker, op)] = Part(method, name, tuple(args), parts, seq,
                                                    time.monotonic(), would, framed)
        finally:
            ck = self._done(worker, seq)
        return (STAGED, would), ck, 0, 0

    def commit(self, name: str, worker: str, seq: int, op: int, tick: bool = False) -> Any:
        """Apply the staged part of operation ``op``; the answer the request would have had.

        ``tick``: the operation's decision that the optimizer counts this step (some shard
        changes rows). A commit sent again is not applied again: it is answered as before (a
        pull's rows, gone by then, with :data:`REREAD`).
        """
        state = self._admit(worker, seq, True, freezable=False)
        if state == BEHIND:
            return BEHIND
        part = self.ledger.staged.pop((worker, op), None) if state == "apply" else None
        if part is None:
            if state == "apply":
                self._done(worker, seq)
            return self._repeated(worker, op)
        try:
            out = self._apply_part(worker, op, part, tick)
        finally:
            ck = self._done(worker, seq) if state == "apply" else \
                self.ckpt_applied.get(worker, 0)
        answer = (out[0], ck, *out[1:])
        return wire.pack_reply(answer) if part.framed else answer

    def _apply_part(self, worker: str, op: int, part: Part, tick: bool) -> tuple[Any, int, int]:
        """Apply a staged part (recording the operation as committed); ``(value, delta, seq)``."""
        code = 1
        try:
            if part.method == "pull":
                kc, insert, touch = part.args[0], part.args[1], part.args[2]
                out = part.args[3] if len(part.args) > 3 else None
                value, delta, after = self._pull_core(part.name, kc, insert, touch, out)
                if out is not None:
                    value = self._rows_in((value, 0, 0, 0), out, kc.shape[1])[0]
            elif part.method == "push":
                keys, grads, step, own_tick = part.args
                decided = bool(own_tick or tick)
                code = 2 if decided else 1
                value, delta, after = self._push_core(part.name, keys, grads, step, decided,
                                                      decided=True)
            else:
                value, delta, after = self._call_core(part.name, part.args[0], part.args[1])
        finally:
            self.ledger.record(worker, op, code)
        if part.method != "pull":
            self.ledger.answers[worker] = (op, (value, delta, after))
        return value, delta, after

    def _repeated(self, worker: str, op: int) -> Any:
        """The answer to a commit of an operation no longer staged here."""
        st, _ = self.ledger.status(worker, op)
        if st != COMMITTED:
            raise ShardUnavailableError(
                f"operation {op} of client {worker!r} is {st} on shard {self.index}, not staged: "
                "it was undone (its client was taken for dead, or this shard restarted from a "
                "checkpoint and lost it); run it again")
        ck = self.ckpt_applied.get(worker, 0)
        last = self.ledger.answers.get(worker)
        if last is not None and last[0] == op:
            value, _, after = last[1]
            return value, ck, 0, after
        return REREAD

    def abort(self, name: str, worker: str, seq: int, op: int) -> Any:
        """Drop the staged part of operation ``op`` (and refuse it from now on)."""
        state = self._admit(worker, seq, True, freezable=False)
        if state == BEHIND:
            return BEHIND
        if state == "apply":
            self._decide(worker, op, False, False)
            return None, self._done(worker, seq), 0, 0
        return None, self.ckpt_applied.get(worker, 0), 0, 0

    # --- resolution of operations whose client went quiet (tensorkv.distributed.ops) -------
    def op_status(self, worker: str, op: int, tombstone: bool = False) -> tuple[str, int]:
        """What became of operation ``op`` of ``worker`` here (:meth:`Ledger.status`).

        With ``tombstone``, an operation this shard never got is refused from now on (its
        part can no longer be staged): answered ``"aborted"``.
        """
        st, code = self.ledger.status(worker, op)
        if st == NONE and tombstone:
            self.ledger.record(worker, op, 0)
            return ABORTED, 0
        return st, code

    def decide(self, worker: str, op: int, commit: bool, tick: bool) -> bool:
        """A resolution's decision on operation ``op`` of ``worker``; whether a part was here."""
        return self._decide(worker, op, commit, tick)

    def _decide(self, worker: str, op: int, commit: bool, tick: bool) -> bool:
        part = self.ledger.staged.pop((worker, op), None)
        if part is None:
            # an abort refuses the part from now on; a commit leaves the state as it is (a
            # restarted shard gets the part again from its live client, then the commit)
            if not commit and self.ledger.status(worker, op)[0] in (NONE, UNKNOWN):
                self.ledger.record(worker, op, 0)
            return False
        if commit:
            self._apply_part(worker, op, part, tick)
            if self.url is not None:
                self.checkpoint()  # no client holds this change to send it again
        else:
            self.ledger.record(worker, op, 0)
        return True

    def pending(self) -> list[tuple[str, int, tuple[int, ...], float, list[Any]]]:
        """``(worker, op, parts, age in seconds, [lease])`` of every part staged here."""
        now = time.monotonic()
        out = []
        for (w, op), p in list(self.ledger.staged.items()):
            lease = self.ledger.leases.get(w)
            out.append((w, op, p.parts, now - p.since, [] if lease is None else [lease]))
        return out

    # --- operations ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Rows, bytes, tiers and request rate of the shard."""
        now = time.time()
        tabs = {}
        for n, t in self.tables.items():
            st = t.stats()
            tabs[n] = {"rows": st["rows"], "bytes": st["bytes"], "step": st["step"],
                       "optimizer_step": int(t.optimizer.step),
                       "tiers": [{k: v for k, v in tier.items() if k in ("rows", "bytes")}
                                 for tier in st.get("tiers", [])]}
        return {**self.info(), "tables": tabs, "requests": self.requests,
                "uptime_s": now - self.started,
                "requests_per_s": self.requests / max(now - self.started, 1e-9),
                "checkpoint_version": self.ckpt_version, "staged": len(self.ledger.staged),
                "frozen": bool(self.ledger.freezes)}

    def close(self) -> None:
        """Flush and close every table's storage (and stop the janitor)."""
        if self.janitor is not None:
            self.janitor.stopped.set()
        for t in self.tables.values():
            t.close()

    def ping(self) -> int:
        """Nothing: the cost of one call (the ``bench ps`` overhead figure)."""
        return os.getpid()


def _starts(rows: Any, buf: np.ndarray, u: int) -> bool:
    """Whether ``rows`` are the first ``u`` rows of ``buf`` (rows per key written there)."""
    return (isinstance(rows, np.ndarray) and rows.shape[0] == u
            and rows.__array_interface__["data"][0] == buf.__array_interface__["data"][0])


__all__ = ["BEHIND", "REFUSED", "TABLE_METHODS", "ShardServer", "checkpoint_prefix", "dumps"]
