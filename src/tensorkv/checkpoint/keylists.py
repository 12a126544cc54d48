"""Key lists of table shards in checkpoints: full lists, deltas along a chain, and a cache.

A full save of a table shard stores its sorted key list (``k/`` pieces). An incremental save
stores only the keys added (``a/``) and removed (``r/``) since its parent, so its cost scales
with the changed rows rather than with the table: a 5M-key table's full list is 40 MB, which
writing and reading again on every incremental save would cost more than the 1% of rows that
changed. The key set at any tag is rebuilt from the nearest full list up the parent chain
(:func:`chain_key_set`). Tags written before format version 2 store a full list at every tag,
so a chain read stops at the first of them.

The key set of the state a table object last saved is kept in memory with that object (a
:class:`KeySet`, 8 bytes per key), so the next incremental save of the same object needs not
read anything back; any other parent state is rebuilt from the store. The records and the
rules are in "Atomic tags, incremental saves, sharded saves" in ``docs/format.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from tensorkv.checkpoint import layout
from tensorkv.codec import decode, encode_parts
from tensorkv.embedding.protocol import Table
from tensorkv.errors import CheckpointError, CorruptRecordError
from tensorkv.stores.base import KVStore

if TYPE_CHECKING:
    from tensorkv.checkpoint.writer import BlockWriter

KEYS_PER_PIECE = 512 * 1024  # int64 keys per key-list record (4 MiB)
FULL = b"k"  # the shard's sorted key list at the tag
ADDED = b"a"  # keys present at the tag and absent at the parent (sorted)
REMOVED = b"r"  # keys present at the parent and absent at the tag (sorted)
# A KeySet folds its delta arrays into its base once they exceed this share of the base.
_COMPACT_FRACTION = 1 / 8
_EMPTY = np.empty(0, dtype=np.int64)


def write_key_list(w: BlockWriter, keys: np.ndarray, kind: bytes = FULL) -> int:
    """Queue a sorted int64 key array on a :class:`BlockWriter` as pieces; return their count.

    An empty array is one empty piece (a full list always has at least one record).
    """
    pieces = 0
    for off in range(0, max(len(keys), 1), KEYS_PER_PIECE):
        part = np.ascontiguousarray(keys[off : off + KEYS_PER_PIECE], dtype=np.int64)
        head, payload = encode_parts(part)
        buf = w.alloc(len(head) + payload.nbytes)  # a reused buffer: no fresh pages
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        buf[len(head) :] = part.view(np.uint8)
        w.put(piece_key(w.prefix, kind, pieces), buf)
        pieces += 1
    return pieces


def piece_key(prefix: bytes, kind: bytes, n: int) -> bytes:
    """Key of piece ``n`` of the key list ``kind`` (``k``, ``a`` or ``r``) under a prefix."""
    return prefix + kind + b"/%08d" % n


def read_key_list(
    store: KVStore, prefix: bytes, pieces: int, what: str, kind: bytes = FULL
) -> np.ndarray:
    """Read a key list written by :func:`write_key_list` (verifying each piece's checksum)."""
    keys = [piece_key(prefix, kind, i) for i in range(pieces)]
    out = []
    for k, v in zip(keys, store.get_many(keys) if keys else [], strict=True):
        if v is None:
            raise CorruptRecordError(f"{what}: key-list record {k.decode()} is missing")
        out.append(decode(v, key=k.decode()))
    if not out:
        return _EMPTY
    return out[0] if len(out) == 1 else np.concatenate(out)


def sorted_member(sorted_hay: np.ndarray, needles: np.ndarray) -> np.ndarray:
    """Boolean mask: which needles occur in the sorted int64 array ``sorted_hay``.

    Ascending needles take a galloping merge (:func:`tensorkv.checkpoint.gather.member_sorted`),
    others one binary search each.
    """
    if len(sorted_hay) == 0 or len(needles) == 0:
        return np.zeros(len(needles), dtype=bool)
    needles = np.ascontiguousarray(needles, dtype=np.int64)
    if len(needles) > 1 and bool((needles[1:] >= needles[:-1]).all()):
        from tensorkv.checkpoint.gather import member_sorted

        return member_sorted(np.ascontiguousarray(sorted_hay, dtype=np.int64), needles)
    pos = np.searchsorted(sorted_hay, needles)
    pos[pos == len(sorted_hay)] = 0
    return sorted_hay[pos] == needles


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


class KeySet:
    """An immutable set of int64 keys: ``(base - removed) | added``, each part sorted.

    ``removed`` is a subset of ``base`` and ``added`` is disjoint from it, so applying a delta
    costs time in the size of the delta, not of the set; the parts are folded into one sorted
    base once the deltas exceed an eighth of it.
    """

    __slots__ = ("added", "base", "removed")

    def __init__(self, base: np.ndarray, removed: np.ndarray = _EMPTY,
                 added: np.ndarray = _EMPTY) -> None:
        self.base = _frozen(base)
        self.removed = _frozen(removed)
        self.added = _frozen(added)

    def __len__(self) -> int:
        return len(self.base) - len(self.removed) + len(self.added)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``keys`` are in the set (sorted keys are fastest)."""
        keys = np.asarray(keys, dtype=np.int64)
        hit = sorted_member(self.base, keys)
        if len(self.removed):
            hit &= ~sorted_member(self.removed, keys)
        if len(self.added):
            hit |= sorted_member(self.added, keys)
        return hit

    def apply(self, added: np.ndarray, removed: np.ndarray, *, check: bool = True) -> KeySet:
        """The set after a delta: ``added`` (sorted, none in the set) and ``removed``.

        ``removed`` (sorted) must be a subset of the set. With ``check``, a delta that breaks
        either rule raises :class:`CorruptRecordError` (the key lists of a chain do not fit
        together); callers that computed the delta against this set pass ``check=False``.
        """
        added = np.asarray(added, dtype=np.int64)
        removed = np.asarray(removed, dtype=np.int64)
        if check and len(added) and self.contains(added).any():
            raise CorruptRecordError("a key-list delta adds keys the parent already holds")
        if check and len(removed) and not self.contains(removed).all():
            raise CorruptRecordError("a key-list delta removes keys the parent does not hold")
        in_added = sorted_member(self.added, removed)
        new_added = self.added[~sorted_member(removed, self.added)] if in_added.any() \
            else self.added
        new_removed = _union(self.removed, removed[~in_added])
        back = sorted_member(self.base, added)  # base keys removed earlier, now back
        if back.any():
            new_removed = new_removed[~sorted_member(added[back], new_removed)]
        new_added = _union(new_added, added[~back])
        out = KeySet(self.base, new_removed, new_added)
        if len(new_added) + len(new_removed) > max(len(self.base) * _COMPACT_FRACTION, 4096):
            out = KeySet(out.to_array())
        return out

    def to_array(self) -> np.ndarray:
        """The keys as one sorted int64 array (read-only when nothing was folded)."""
        if not len(self.removed) and not len(self.added):
            return self.base
        keep = self.base
        if len(self.removed):
            keep = np.delete(keep, np.searchsorted(keep, self.removed))
        if len(self.added):
            keep = np.insert(keep, np.searchsorted(keep, self.added), self.added)
        return keep


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted union of two sorted, disjoint int64 arrays."""
    if not len(b):
        return a
    if not len(a):
        return b
    return np.insert(a, np.searchsorted(a, b), b)


# ----------------------------------------------------------------------------- chains
def chain_key_set(
    store: KVStore, doc: dict[str, Any], name: str, shard: str,
    load_manifest: Callable[[str], dict[str, Any] | None],
) -> KeySet:
    """The key set of one saved shard of a table at a tag, from its key lists.

    Walks from ``doc`` up the parent chain to the nearest full key list, then applies the
    deltas oldest first. ``load_manifest(tag)`` returns a parent's manifest or None when it is
    missing (:func:`tensorkv.checkpoint.manifest.getter`). Each link's count is checked against
    its manifest's ``num_keys``.
    """
    links = []
    d = doc
    seen: set[str] = set()
    while True:
        ent = d["tables"].get(name)
        info = None if ent is None else ent["shards"].get(shard)
        if info is None:
            raise CheckpointError(
                f"table {name!r}: tag {d['tag']!r} in the chain of {doc['tag']!r} lacks "
                f"shard {shard}"
            )
        prefix = layout.table_prefix(
            ent.get("data_tag", d["tag"]), name, int(shard), ent.get("hash_tag")
        )
        links.append((d["tag"], prefix, info))
        if info.get("key_list", "full") == "full":
            break
        if d["tag"] in seen:
            raise CheckpointError(f"table {name!r}: cycle in the parent chain of {doc['tag']!r}")
        seen.add(d["tag"])
        parent = d.get("parent")
        pdoc = None if parent is None else load_manifest(parent)
        if pdoc is None:
            raise CheckpointError(
                f"table {name!r} of tag {d['tag']!r} lists its keys as a delta on tag "
                f"{parent!r}, which is missing: the chain is broken"
            )
        d = pdoc
    ks: KeySet | None = None
    for tag, prefix, info in reversed(links):
        what = f"table {name!r} (tag {tag!r}, shard {shard})"
        if ks is None:
            ks = KeySet(read_key_list(store, prefix, info.get("key_pieces", 0), what, FULL))
        else:
            add = read_key_list(store, prefix, info.get("added_pieces", 0), what, ADDED)
            rem = read_key_list(store, prefix, info.get("removed_pieces", 0), what, REMOVED)
            try:
                ks = ks.apply(add, rem)
            except CorruptRecordError as exc:
                raise CorruptRecordError(f"{what}: {exc}") from None
        if "num_keys" in info and len(ks) != int(info["num_keys"]):
            raise CorruptRecordError(
                f"{what}: its key lists hold {len(ks)} keys, the manifest says "
                f"{info['num_keys']}; the tag is damaged"
            )
    assert ks is not None
    return ks


# ----------------------------------------------------------------------------- cache
_CACHE: weakref.WeakKeyDictionary[Any, tuple[str, KeySet]] = weakref.WeakKeyDictionary()


def cached(table: Table, state: str) -> KeySet | None:
    """The key set of ``table`` at checkpoint state ``state``, if this process keeps it."""
    try:
        hit = _CACHE.get(table)
    except TypeError:  # not weak-referenceable
        return None
    return hit[1] if hit is not None and hit[0] == state else None


def remember(table: Table, state: str, keys: KeySet) -> None:
    """Keep ``keys`` as the key set of ``table`` at ``state`` (replacing any earlier one)."""
    with contextlib.suppress(TypeError):  # not weak-referenceable: nothing is kept
        _CACHE[table] = (state, keys)
