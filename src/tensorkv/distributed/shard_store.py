"""A shard's checkpoints and sharded saves: :class:`ShardStore`, a part of ``ShardServer``.

Periodic checkpoints (``ps-<name>-g<generation>-s<shard>-<n>``) hold the shard's tables, the
sequence numbers of the clients' requests they contain and the outcomes of recent operations
over several shards (:mod:`tensorkv.distributed.ops`); a restarted shard reloads the newest.
Sharded saves (:meth:`ShardStore.save_shard`) write the shard's rows as one shard of an
ordinary tag, at the agreed state a save barrier (:meth:`ShardStore.freeze`) brings every
shard to.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import time
import warnings
from typing import Any

from tensorkv.checkpoint import delete_tag, list_tags, load, save, tag_manifest
from tensorkv.distributed.ops import Ledger
from tensorkv.embedding.table import EmbeddingTable
from tensorkv.errors import ConfigError, import_optional


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with cloudpickle (table arguments may hold lambdas: lr schedules)."""
    return import_optional("ray.cloudpickle", "the parameter server", "ray").dumps(obj)


def checkpoint_prefix(ps_name: str, generation: int, index: int) -> str:
    """Tag prefix of the periodic checkpoints of one shard."""
    return f"ps-{ps_name}-g{generation}-s{index}-"


class ShardStore:
    """Checkpoints, recovery, sharded saves and loads of a shard (mixed into ``ShardServer``)."""

    url: str | None
    index: int
    num_shards: int
    prefix: str
    tables: dict[str, EmbeddingTable]
    specs: dict[str, dict[str, Any]]
    applied: dict[str, int]
    ckpt_applied: dict[str, int]
    ckpt_version: int
    ckpt_tag: str | None
    full_every: int
    since_full: int
    since_ckpt: int
    requests: int
    restored_from: str | None
    ledger: Ledger
    retired: tuple[int, int] | None

    def _build(self, name: str, spec: dict[str, Any]) -> EmbeddingTable:
        raise NotImplementedError

    def _table(self, name: str) -> EmbeddingTable:
        raise NotImplementedError

    def _check_retired(self) -> None:
        raise NotImplementedError

    # --- periodic checkpoints --------------------------------------------------------------
    def checkpoint(self) -> str | None:
        """Save every table of the shard (incrementally after the first) as a new tag."""
        if self.url is None:
            return None
        self.ckpt_version += 1
        tag = f"{self.prefix}{self.ckpt_version:08d}"
        applied = {w: self.ledger.low_water(w, a) for w, a in self.applied.items()}
        meta = {"applied": applied, "ops": self.ledger.to_meta(),
                "specs": base64.b64encode(dumps(self.specs)).decode(),
                "version": self.ckpt_version}
        full = self.ckpt_tag is None or self.since_full + 1 >= self.full_every
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a first save after a restart is a full one
            save(dict(self.tables), self.url, tag, incremental=not full,
                 parent=None if full else self.ckpt_tag, metadata=meta, progress=False)
        self.ckpt_tag = tag
        self.ckpt_applied = applied
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
        doc = tag_manifest(self.url, tag)
        meta = doc.get("metadata") or {}
        specs = pickle.loads(base64.b64decode(meta["specs"]))
        self.tables = {n: self._build(n, s) for n, s in specs.items()}
        self.specs = specs
        if self.tables:
            load(dict(self.tables), self.url, tag, progress=False)
        self.applied = {str(k): int(v) for k, v in meta["applied"].items()}
        self.ckpt_applied = dict(self.applied)
        self.ledger.load_meta(meta.get("ops"))
        self.ckpt_version = int(meta["version"])
        self.ckpt_tag = tag
        self.restored_from = tag
        return True

    def _load_from(self, url: str, tag: str) -> None:
        """Fill the tables from shard ``index`` of ``num_shards`` of a (sharded) checkpoint."""
        doc = tag_manifest(url, tag)
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

    # --- save barriers --------------------------------------------------------------------
    def freeze(self, token: str, worker: str) -> bool:
        """Refuse new parts and changes (``REFUSED``) until :meth:`thaw` of ``token``.

        A save's barrier: with every shard frozen and no part left staged, every shard holds
        the same operations, and each saves its rows at that agreed state. Parts staged
        before are still committed or aborted. The janitor thaws a freeze whose ``worker``
        died.
        """
        self._check_retired()
        self.ledger.freezes[token] = (worker, time.monotonic())
        return True

    def thaw(self, token: str) -> bool:
        """End the freeze ``token``; whether it held."""
        return self.ledger.freezes.pop(token, None) is not None

    def frozen(self) -> bool:
        """Whether a save barrier holds here."""
        self._check_retired()
        return bool(self.ledger.freezes)

    def retire(self, generation: int, num_shards: int) -> None:
        """Answer every later request with :class:`~tensorkv.errors.ReshardedError`.

        After a reshard to ``num_shards`` shards of ``generation``, a client still holding
        this shard gets an error saying so, never rows of a shard set that no longer serves.
        """
        self.retired = (int(generation), int(num_shards))
        self.ledger.freezes.clear()

    # --- sharded saves and loads -----------------------------------------------------------
    def snapshot(self, names: list[str]) -> dict[str, Any]:
        """The state of tables ``names`` a save writes: the tables themselves, for now.

        A save runs inside one call of the shard actor, so nothing changes them while it
        writes. (A copy-on-write snapshot would let the shard serve requests meanwhile.)
        """
        return {n: self._table(n) for n in names}

    def save_shard(self, url: str, tag: str, names: list[str] | None,
                   metadata: dict[str, Any] | None, options: dict[str, Any] | None = None,
                   as_name: str | None = None, thaw: str | None = None,
                   retire: tuple[int, int] | None = None) -> str:
        """Save this shard's tables as shard ``index`` of ``num_shards`` of tag ``tag``.

        ``options``: more :func:`tensorkv.save` arguments (``step``, ``incremental``,
        ``parent``, ``ttl``); ``as_name``: save the one table of ``names`` under this name.
        Afterwards ``thaw`` ends that save barrier here (see ``ShardServer.freeze``), and
        ``retire`` = ``(generation, num_shards)`` retires the shard (a reshard), even if the
        save failed.
        """
        self.requests += 1
        try:
            names = sorted(self.tables) if names is None else names
            tabs = self.snapshot(names)
            specs = {n: self.specs[n] for n in names}
            if as_name is not None:
                (only,) = names
                tabs, specs = {as_name: tabs[only]}, {as_name: specs[only]}
            meta = dict(metadata or {})
            meta["ps_specs"] = base64.b64encode(dumps(specs)).decode()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an incremental save whose parent is unknown
                save(tabs, url, tag, shard=self.index, num_shards=self.num_shards,
                     metadata=meta, progress=False, **(options or {}))
        finally:
            if retire is not None:
                self.retire(*retire)
            elif thaw is not None:
                self.thaw(thaw)
        return tag

    def load_shard(self, url: str, tag: str, names: list[str] | None,
                   saved_as: str | None = None) -> int:
        """Replace this shard's tables' rows with their rows in tag ``tag`` (any shard count).

        Tables the shard does not have are created from the checkpoint; ``saved_as``: the one
        table of ``names`` is stored under that name. Returns the rows the shard holds
        afterwards. Clients must be idle (their logs are not replayed across it).
        """
        self.requests += 1
        doc = tag_manifest(url, tag)
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


__all__ = ["ShardStore", "checkpoint_prefix", "dumps"]
