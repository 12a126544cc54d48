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
"""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import pickle
import time
import uuid
import warnings
from typing import Any

import numpy as np

from tensorkv.checkpoint import delete_tag, list_tags, load, save, tag_info
from tensorkv.distributed import shm, wire
from tensorkv.distributed.wire import BEHIND
from tensorkv.embedding.filters import Eviction
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import ConfigError, TagNotFoundError, import_optional

#: Methods of the table a client may call through :meth:`ShardServer.call`, and whether each
#: changes the table (mutating calls carry a sequence number and are applied exactly once).
TABLE_METHODS: dict[str, bool] = {
    "upsert": True, "remove": True, "evict_keys": True, "clear": True, "evict": True,
    "import_": True, "set_step": True, "load_state_meta": True, "optimizer_tick": True,
    "contains": False, "frequency": False, "version": False, "keys": False, "len": False,
    "stats": False, "state_dict_meta": False, "mutation_seq": False, "step": False,
    "export": False, "wait_writes": False, "flush": False, "eviction_candidates": False,
}


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with cloudpickle (table arguments may hold lambdas: lr schedules)."""
    return import_optional("ray.cloudpickle", "the parameter server", "ray").dumps(obj)


def checkpoint_prefix(ps_name: str, generation: int, index: int) -> str:
    """Tag prefix of the periodic checkpoints of one shard."""
    return f"ps-{ps_name}-g{generation}-s{index}-"


class ShardServer:
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
    """

    def __init__(self, ps_name: str, index: int, num_shards: int, generation: int = 0,
                 checkpoint_url: str | None = None, checkpoint_every: int = 100,
                 init_from: tuple[str, str] | None = None, full_every: int = 20) -> None:
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
        if self.url is not None and self._recover():
            return
        if init_from is not None:
            self._load_from(*init_from)
            if self.url is not None:
                self.checkpoint()

    # --- identity --------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """Shard number, generation, pid, tables, the checkpoint it restored from."""
        return {"index": self.index, "num_shards": self.num_shards, "pid": os.getpid(),
                "generation": self.generation, "tables": sorted(self.tables),
                "restored_from": self.restored_from, "checkpoint": self.ckpt_tag,
                "checkpoint_url": self.url}

    def applied_seq(self, worker: str) -> tuple[int, int]:
        """``(last applied, last checkpointed)`` sequence numbers of ``worker``."""
        return self.applied.get(worker, 0), self.ckpt_applied.get(worker, 0)

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

        Returns its ``dim`` and whether it was created now. A table that exists keeps its
        arguments; the client compares them.
        """
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
    def _admit(self, worker: str, seq: int, mutating: bool) -> str:
        """``"apply"``, ``"dup"`` (a retry of an applied request) or :data:`BEHIND`."""
        self.requests += 1
        last = self.applied.get(worker, 0)
        if not mutating:
            return "apply" if seq <= last else BEHIND
        if seq <= last:
            return "dup"
        if seq != last + 1:
            return BEHIND
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

    # --- the data path ---------------------------------------------------------------------
    def pull(self, name: str, worker: str, seq: int, keys_counts: np.ndarray,
             insert: bool, touch: bool = False, out: np.ndarray | None = None) -> Any:
        """Rows of distinct keys, each seen some times (a lookup of every sighting).

        ``keys_counts`` is int64 ``[2, n]``: the keys, and how often each was seen (one
        array: each array argument of a Ray call costs its own serialisation).

        Returns ``(rows, ckpt_seq, seq_delta, seq)`` (``seq_delta``: how much the table's
        ``mutation_seq`` grew, to ``seq``): ``rows`` is ``[len(keys), dim]``, or ``[counts.sum(),
        dim]`` (one row per sighting, grouped by key) in the rare case where sightings of one
        key read differently (an admission filter admitting a key mid-batch, with a
        ``default_value``); or :data:`BEHIND`. With ``touch`` (the lookup of keys a
        :meth:`peek` read already) ``rows`` is ``(absent, rows[absent])``: only the rows of
        keys that had no row before, unless the rows are per sighting. ``out``: where to
        write rows per key (``[len(keys), dim]`` float32; rows per sighting go elsewhere).
        """
        state = self._admit(worker, seq, insert)
        if state == BEHIND:
            return BEHIND
        keys, counts = keys_counts[0], keys_counts[1]
        t = self._table(name)
        if state == "dup" or not insert:
            rows = self._lookup(t, keys, counts, False, out)
            return rows, (self.ckpt_applied.get(worker, 0) if insert else 0), 0, 0
        before = t.mutation_seq
        try:
            absent = ~t.contains(keys) if touch else None
            rows = self._lookup(t, keys, counts, True, out)
        finally:
            ck = self._done(worker, seq)
        after = t.mutation_seq
        if absent is not None and rows.shape[0] == keys.shape[0]:
            return (absent, rows[absent]), ck, after - before, after
        return rows, ck, after - before, after

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
        res = self.pull(name, worker, seq, kc, insert, out=out)
        if isinstance(res, str) or not _starts(res[0], out, kc.shape[1]):
            return res
        return (shm.Rows(*res[0].shape), *res[1:])

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
        if state == BEHIND:
            return BEHIND
        if state == "dup":
            t = self._table(name)
            return (0, t.step), self.ckpt_applied.get(worker, 0), 0, 0
        t = self._table(name)
        before = t.mutation_seq
        try:
            n = t.apply_gradients(keys, grads, step=step, unique=True)  # distinct keys
            if n == 0 and tick:
                self._tick(t)
        finally:
            ck = self._done(worker, seq)
        after = t.mutation_seq
        return (n, t.step), ck, after - before, after

    def frame(self, data: bytes) -> bytes:
        """A ``pull``, ``peek`` or ``push`` request packed as one frame; the answer packed.

        See :mod:`tensorkv.distributed.wire` (small requests travel so).
        """
        method, name, worker, seq, args = wire.unpack_request(data)
        return wire.pack_reply(getattr(self, method)(name, worker, seq, *args))

    def call(self, name: str, worker: str, seq: int, method: str, args: tuple) -> Any:
        """Any other table method (:data:`TABLE_METHODS`); ``(result, ckpt, delta, seq)``."""
        mutating = TABLE_METHODS.get(method)
        if mutating is None:
            raise ConfigError(f"{method!r} is not a table method a shard serves; use one of "
                              f"{sorted(TABLE_METHODS)}")
        state = self._admit(worker, seq, mutating)
        if state == BEHIND:
            return BEHIND
        if state == "dup":
            return None, self.ckpt_applied.get(worker, 0), 0, 0
        t = self._table(name)
        before = t.mutation_seq
        try:
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
        finally:
            ck = self._done(worker, seq) if mutating else 0
        after = t.mutation_seq
        return out, ck, after - before, after

    @staticmethod
    def _tick(t: EmbeddingTable) -> None:
        """Count one optimizer step without rows (what an update elsewhere counts)."""
        state = dict(t.optimizer.state())
        state["step"] = int(state["step"]) + 1
        t.optimizer.load_state(state)

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

    # --- checkpoints -----------------------------------------------------------------------
    def checkpoint(self) -> str | None:
        """Save every table of the shard (incrementally after the first) as a new tag."""
        if self.url is None:
            return None
        self.ckpt_version += 1
        tag = f"{self.prefix}{self.ckpt_version:08d}"
        meta = {"applied": self.applied,
                "specs": base64.b64encode(dumps(self.specs)).decode(),
                "version": self.ckpt_version}
        full = self.ckpt_tag is None or self.since_full + 1 >= self.full_every
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a first save after a restart is a full one
            save(dict(self.tables), self.url, tag, incremental=not full,
                 parent=None if full else self.ckpt_tag, metadata=meta, progress=False)
        self.ckpt_tag = tag
        self.ckpt_applied = dict(self.applied)
        self.since_ckpt = 0
        self.since_full = 0 if full else self.since_full + 1
        if full:  # the older tags are needed no more: newest first, children before parents
            older = [t for t in list_tags(self.url) if t.startswith(self.prefix) and t < tag]
            for old in reversed(older):
                with contextlib.suppress(Exception):
                    delete_tag(self.url, old)
        return tag

    def _recover(self) -> bool:
        """Load the newest own checkpoint, if any; whether there was one."""
        assert self.url is not None
        try:
            tags = [t for t in list_tags(self.url) if t.startswith(self.prefix)]
        except Exception:  # a store that does not exist yet holds no checkpoint
            return False
        if not tags:
            return False
        tag = max(tags)
        doc = tag_info(self.url, tag)
        meta = doc.get("metadata") or {}
        specs = pickle.loads(base64.b64decode(meta["specs"]))
        self.tables = {n: self._build(n, s) for n, s in specs.items()}
        self.specs = specs
        if self.tables:
            load(dict(self.tables), self.url, tag, progress=False)
        self.applied = {str(k): int(v) for k, v in meta["applied"].items()}
        self.ckpt_applied = dict(self.applied)
        self.ckpt_version = int(meta["version"])
        self.ckpt_tag = tag
        self.restored_from = tag
        return True

    def _load_from(self, url: str, tag: str) -> None:
        """Fill the tables from shard ``index`` of ``num_shards`` of a (sharded) checkpoint."""
        try:
            doc = tag_info(url, tag)
        except TagNotFoundError:
            raise
        meta = doc.get("metadata") or {}
        specs = pickle.loads(base64.b64decode(meta["ps_specs"])) if "ps_specs" in meta else {}
        for n, ent in doc["tables"].items():
            spec = specs.get(n)
            self.tables[n] = (self._build(n, spec) if spec is not None
                              else EmbeddingTable.from_meta(ent["meta"]))
            self.specs[n] = spec if spec is not None else {"dim": ent["dim"]}
        if self.tables:
            load(dict(self.tables), url, tag, shard=self.index, num_shards=self.num_shards,
                 progress=False)
        self.restored_from = tag

    def save_shard(self, url: str, tag: str, names: list[str] | None,
                   metadata: dict[str, Any] | None, options: dict[str, Any] | None = None,
                   as_name: str | None = None) -> str:
        """Save this shard's tables as shard ``index`` of ``num_shards`` of tag ``tag``.

        ``options``: more :func:`tensorkv.save` arguments (``step``, ``incremental``,
        ``parent``, ``ttl``); ``as_name``: save the one table of ``names`` under this name.
        """
        self.requests += 1
        names = sorted(self.tables) if names is None else names
        tabs = {n: self._table(n) for n in names}
        specs = {n: self.specs[n] for n in names}
        if as_name is not None:
            (only,) = names
            tabs, specs = {as_name: tabs[only]}, {as_name: specs[only]}
        meta = dict(metadata or {})
        meta["ps_specs"] = base64.b64encode(dumps(specs)).decode()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an incremental save whose parent is unknown
            save(tabs, url, tag, shard=self.index, num_shards=self.num_shards, metadata=meta,
                 progress=False, **(options or {}))
        return tag

    def load_shard(self, url: str, tag: str, names: list[str] | None,
                   saved_as: str | None = None) -> int:
        """Replace this shard's tables' rows with their rows in tag ``tag`` (any shard count).

        Tables the shard does not have are created from the checkpoint; ``saved_as``: the one
        table of ``names`` is stored under that name. Returns the rows the shard holds
        afterwards. Clients must be idle (their logs are not replayed across it).
        """
        self.requests += 1
        doc = tag_info(url, tag)
        meta = doc.get("metadata") or {}
        specs = pickle.loads(base64.b64decode(meta["ps_specs"])) if "ps_specs" in meta else {}
        if saved_as is not None and names is not None:  # one table, saved under that name
            (only,) = names
            self._table(only)
            if saved_as not in doc["tables"]:
                raise ConfigError(f"tag {tag!r} holds no table {saved_as!r}; it holds "
                                  f"{sorted(doc['tables'])}")
            load({saved_as: self.tables[only]}, url, tag, shard=self.index,
                 num_shards=self.num_shards, progress=False)
            if self.url is not None:
                self.checkpoint()
            return len(self.tables[only])
        names = sorted(doc["tables"]) if names is None else names
        for n in names:
            if n not in self.tables:
                spec = specs.get(n)
                self.tables[n] = (self._build(n, spec) if spec is not None
                                  else EmbeddingTable.from_meta(doc["tables"][n]["meta"]))
                self.specs[n] = spec if spec is not None else {"dim": doc["tables"][n]["dim"]}
        load({n: self.tables[n] for n in names}, url, tag, shard=self.index,
             num_shards=self.num_shards, progress=False)
        if self.url is not None:
            self.checkpoint()
        return sum(len(self.tables[n]) for n in names)

    def forget_checkpoints(self) -> int:
        """Delete this shard's periodic checkpoint tags (at shutdown); how many."""
        if self.url is None:
            return 0
        n = 0
        with contextlib.suppress(Exception):
            for t in reversed([t for t in list_tags(self.url) if t.startswith(self.prefix)]):
                delete_tag(self.url, t)
                n += 1
        return n

    # --- operations ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Rows, bytes, tiers and request rate of the shard."""
        now = time.time()
        tabs = {}
        for n, t in self.tables.items():
            st = t.stats()
            tabs[n] = {"rows": st["rows"], "bytes": st["bytes"], "step": st["step"],
                       "tiers": [{k: v for k, v in tier.items() if k in ("rows", "bytes")}
                                 for tier in st.get("tiers", [])]}
        return {**self.info(), "tables": tabs, "requests": self.requests,
                "uptime_s": now - self.started,
                "requests_per_s": self.requests / max(now - self.started, 1e-9),
                "checkpoint_version": self.ckpt_version}

    def close(self) -> None:
        """Flush and close every table's storage."""
        for t in self.tables.values():
            t.close()

    def ping(self) -> int:
        """Nothing: the cost of one call (the ``bench ps`` overhead figure)."""
        return os.getpid()


def _starts(rows: Any, buf: np.ndarray, u: int) -> bool:
    """Whether ``rows`` are the first ``u`` rows of ``buf`` (rows per key written there)."""
    return (isinstance(rows, np.ndarray) and rows.shape[0] == u
            and rows.__array_interface__["data"][0] == buf.__array_interface__["data"][0])


__all__ = ["BEHIND", "TABLE_METHODS", "ShardServer", "checkpoint_prefix", "dumps"]
