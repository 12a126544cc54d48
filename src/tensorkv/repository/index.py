"""The model log and the prefix index every client keeps in memory.

Every put and delete appends one entry to an append-only log on the metadata provider:
``repo/log/<seq>`` (12 decimal digits), claimed with ``put_if_absent``, so writers in any
process never overwrite each other and readers see a gap-free sequence. A client replays the
log into a :class:`ModelIndex`: the live models, their metrics, and a map from layer hash to
the models holding that layer. Bringing it up to date costs one ``get_many`` when nothing
changed (the cheap version check) and reads only the new entries otherwise.

:meth:`ModelIndex.longest_prefix` answers the generalised longest-common-prefix query from the
map, touching only the models that hold the query's deepest present layers (see
docs/repository.md for the algorithm and its cost).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorkv.errors import ConfigError
from tensorkv.repository.layout import load_json
from tensorkv.stores.base import KVStore

LOG = b"repo/log/"
#: Entries read per round trip while replaying the log.
LOG_BATCH = 1024


def log_key(seq: int) -> bytes:
    """Key of log entry ``seq``."""
    return LOG + b"%012d" % seq


@dataclass
class ModelInfo:
    """What the index knows of one model (from its log entry)."""

    id: str
    name: str | None
    parent: str | None
    metrics: dict[str, float]
    created: float
    seq: int
    keys: np.ndarray  # uint64 layer hashes
    nbytes: int = 0
    tensors: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The model's row as ``Repository.list`` returns it."""
        return {"id": self.id, "name": self.name, "parent": self.parent,
                "metrics": dict(self.metrics), "created": self.created,
                "layers": int(self.keys.size), "tensors": self.tensors, "nbytes": self.nbytes}


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
}


def matcher(where: Any) -> Callable[[dict[str, Any]], bool]:
    """A predicate over model rows from ``where`` (see ``Repository.list``)."""
    if where is None:
        return lambda row: True
    if callable(where):
        return where
    if not isinstance(where, Mapping):
        raise ConfigError(f"where={where!r}: pass a callable(row) -> bool or a dict of "
                          "{field or metric: value or (op, value)}")
    tests = []
    for field, cond in where.items():
        op, value = cond if isinstance(cond, tuple) and len(cond) == 2 else ("==", cond)
        if op not in _OPS:
            raise ConfigError(f"where[{field!r}]: operator {op!r} is not one of {sorted(_OPS)}")
        tests.append((field, _OPS[op], value))

    def pred(row: dict[str, Any]) -> bool:
        for field, fn, value in tests:
            got = row[field] if field in ("id", "name", "parent") else row["metrics"].get(field)
            if got is None or not fn(got, value):
                return False
        return True

    return pred


class ModelIndex:
    """The live models and the layer-hash -> models map, replayed from the log."""

    def __init__(self) -> None:
        self.seq = 0
        self.infos: list[ModelInfo] = []
        self.alive = np.zeros(0, dtype=bool)
        self.ords: dict[str, int] = {}
        self.by_hash: dict[int, list[int]] = {}
        self._metric: dict[str, np.ndarray] = {}
        self._arrays: dict[int, np.ndarray] = {}

    # ----------------------------------------------------------------- the log
    def refresh(self, store: KVStore) -> bool:
        """Apply the log entries written since the last refresh; return whether any were."""
        changed = False
        batch = 4  # grows while the log has more: one small read when nothing changed
        while True:
            keys = [log_key(s) for s in range(self.seq, self.seq + batch)]
            vals = store.get_many(keys)
            for key, v in zip(keys, vals, strict=True):
                if v is None:
                    return changed
                self.apply(load_json(key, v), self.seq)
                self.seq += 1
                changed = True
            batch = min(batch * 4, LOG_BATCH)

    def append(self, store: KVStore, entry: dict[str, Any],
               before: list[tuple[bytes, bytes]] | None = None) -> int:
        """Append ``entry`` to the log after every entry there; return its sequence number.

        One round trip (:meth:`~tensorkv.KVStore.put_first_absent`): ``before`` (the manifest
        the entry publishes) is written in the same step, never after the entry. When other
        writers appended since the last refresh, the entry is applied by the next refresh,
        in log order, like theirs.
        """
        data = json.dumps(entry, separators=(",", ":")).encode()
        seq = store.put_first_absent(LOG, self.seq, data, before or [])
        if seq == self.seq:
            self.apply(entry, seq)
            self.seq += 1
        return seq

    def apply(self, e: dict[str, Any], seq: int) -> None:
        """Apply one log entry."""
        mid = e["id"]
        if e["op"] == "add":
            if mid in self.ords:
                return
            keys = np.frombuffer(bytes.fromhex(e["h"]), dtype="<u8").astype(np.uint64)
            o = len(self.infos)
            self.infos.append(ModelInfo(mid, e.get("name"), e.get("parent"),
                                        dict(e.get("metrics") or {}), e.get("created", 0.0),
                                        seq, keys, int(e.get("b", 0)), int(e.get("n", 0))))
            self.ords[mid] = o
            if o >= self.alive.size:
                grown = np.zeros(max(64, 2 * self.alive.size), dtype=bool)
                grown[: self.alive.size] = self.alive
                self.alive = grown
            self.alive[o] = True
            for k in np.unique(keys).tolist():
                self.by_hash.setdefault(k, []).append(o)
                self._arrays.pop(k, None)
            self._metric.clear()
        elif e["op"] == "del":
            o = self.ords.get(mid, -1)
            if o < 0 or not self.alive[o]:
                return
            self.alive[o] = False
            for k in np.unique(self.infos[o].keys).tolist():
                lst = self.by_hash.get(k)
                self._arrays.pop(k, None)
                if lst is not None:
                    lst.remove(o)
                    if not lst:
                        del self.by_hash[k]

    # ----------------------------------------------------------------- queries
    def live(self) -> list[ModelInfo]:
        """Live models, oldest first."""
        return [m for o, m in enumerate(self.infos) if self.alive[o]]

    def get(self, mid: str) -> ModelInfo | None:
        """The live model ``mid``, or None."""
        o = self.ords.get(mid, -1)
        return self.infos[o] if o >= 0 and self.alive[o] else None

    def holders(self, key: int) -> np.ndarray:
        """Ordinals of the live models holding layer hash ``key`` (int64 array, cached)."""
        arr = self._arrays.get(key)
        if arr is None:
            arr = np.asarray(self.by_hash.get(key, ()), dtype=np.int64)
            self._arrays[key] = arr
        return arr

    def metric(self, name: str) -> np.ndarray:
        """Each model's value of metric ``name`` (-inf where absent), by model ordinal."""
        arr = self._metric.get(name)
        if arr is None:
            vals = [m.metrics.get(name) for m in self.infos]
            arr = np.array([-np.inf if v is None else float(v) for v in vals], dtype=np.float64)
            self._metric[name] = arr
        return arr

    def longest_prefix(
        self, keys: np.ndarray, preds: list[list[int]], metric: str | None
    ) -> tuple[int | None, np.ndarray]:
        """The model sharing the most layers with the query, and which query layers match.

        A query layer matches a model when the model holds its hash (its whole ancestry
        matches). Ties go to the higher ``metric``, then to the older model.

        Returns
        -------
        (ordinal or None, bool mask over the query's layers)
        """
        n = len(keys)
        klist = keys.tolist()
        present = [bool(self.by_hash.get(k)) for k in klist]
        if not any(present):
            return None, np.zeros(n, dtype=bool)
        succ: list[list[int]] = [[] for _ in range(n)]
        anc = [0] * n  # bit masks of each node and its ancestors
        for v in range(n):
            m = 1 << v
            for p in preds[v]:
                succ[p].append(v)
                m |= anc[p]
            anc[v] = m
        remaining = 0
        for v in range(n):
            if present[v]:
                remaining |= 1 << v
        examined: np.ndarray | None = None  # models ranked in earlier rounds
        metric_arr = self.metric(metric) if metric else np.zeros(len(self.infos))
        best: tuple[int, float, int] | None = None  # (count, metric, -ordinal)
        full: np.ndarray | None = None
        while remaining:
            size = remaining.bit_count()
            if best is not None and best[0] > size:
                break
            tops = [v for v in range(n) if remaining >> v & 1
                    and not any(remaining >> s & 1 for s in succ[v])]
            if best is None and len(tops) > 1:
                # remaining is downward closed, so it is the closure of its tops: a model
                # holding every top holds all of it, and no model can hold more
                arrs = sorted((self.holders(klist[v]) for v in tops), key=len)
                common = arrs[0]
                for a in arrs[1:]:
                    common = common[np.isin(common, a, assume_unique=True)]
                    if not common.size:
                        break
                if common.size:
                    mets = metric_arr[common]
                    best_met = mets.max()
                    o = int(common[mets == best_met].min())
                    return o, np.isin(keys, self.infos[o].keys)
            if examined is None:
                examined = np.zeros(len(self.infos), dtype=bool)
            if len(tops) == 1:  # holders hold no repeats
                cands = self.holders(klist[tops[0]])
                cands = cands[~examined[cands]]
                examined[cands] = True
            else:  # a union by mask: linear in the models, but a few microseconds
                fresh = np.zeros(len(self.infos), dtype=bool)
                for v in tops:
                    fresh[self.holders(klist[v])] = True
                fresh &= ~examined
                examined |= fresh
                cands = np.flatnonzero(fresh)
            if cands.size:
                if len(tops) == 1 and remaining & ~anc[tops[0]] == 0:
                    counts = np.full(cands.size, size, dtype=np.int64)
                else:
                    if full is None:
                        full = np.zeros(len(self.infos), dtype=np.int32)
                        n_live = int(self.alive.sum())
                        for v in range(n):
                            if not present[v]:
                                continue
                            if len(self.by_hash[klist[v]]) == n_live:
                                full += 1  # every live model holds it: no gather needed
                            else:
                                full[self.holders(klist[v])] += 1
                    counts = full[cands]
                top = counts.max()
                sel = cands[counts == top]
                mets = metric_arr[sel]
                best_met = mets.max()
                cand = (int(top), float(best_met), -int(sel[mets == best_met].min()))
                if best is None or cand > best:
                    best = cand
            for v in tops:
                remaining &= ~(1 << v)
        assert best is not None
        o = -best[2]
        return o, np.isin(keys, self.infos[o].keys)
