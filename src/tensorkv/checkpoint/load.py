"""``tensorkv.load`` and ``tensorkv.read_tensor``: verify everything, then assign.

:func:`load` reads a tag (following the parent chain of incremental tables) into new arrays
and tables, through the one-pass pipeline of ``bulk.py``, or stages the rows of targets that
cannot bulk import (:func:`stage_table`); the target is changed only once everything read
was verified. Shard selection on restore follows "Table blocks" in ``docs/format.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from tensorkv.checkpoint import bulk, dense, keylists, layout, manifest, tables
from tensorkv.checkpoint.access import using_store
from tensorkv.checkpoint.objects import SINGLE_TABLE_NAME, collect
from tensorkv.checkpoint.progress import OnBytes, bar
from tensorkv.embedding.protocol import Table
from tensorkv.errors import CapacityError, CheckpointError, ShapeError
from tensorkv.pages import FreshPages
from tensorkv.stores.base import KVStore


def _parent_doc(store: KVStore, doc: dict[str, Any], name: str) -> dict[str, Any]:
    parent = doc.get("parent")
    raw = None if parent is None else store.get(layout.manifest_key(parent))
    if raw is None:
        raise CheckpointError(
            f"table {name!r} of tag {doc['tag']!r} is incremental on tag {parent!r}, which is "
            "missing: the chain is broken"
        )
    return manifest.decode_manifest(raw, f"tag {parent!r}")


def table_links(
    store: KVStore, doc: dict[str, Any], name: str
) -> dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]]:
    """Chain of each saved shard of a table.

    Returns, per saved shard, the links (tag, table entry, shard info), oldest first, from
    the last full save up to ``doc``.
    """
    ent = doc["tables"][name]
    out = {}
    for s in ent["shards"]:
        links = []
        d, e = doc, ent
        seen = set()
        while True:
            info = e["shards"].get(s)
            if info is None:
                raise CheckpointError(
                    f"table {name!r}: tag {d['tag']!r} in its chain lacks shard {s}"
                )
            links.append((d["tag"], e, info))
            if info.get("full", e.get("full", True)):
                break
            if d["tag"] in seen:
                raise CheckpointError(
                    f"table {name!r}: cycle in the parent chain of {doc['tag']!r}"
                )
            seen.add(d["tag"])
            d = _parent_doc(store, d, name)
            e = d["tables"].get(name)
            if e is None:
                raise CheckpointError(
                    f"table {name!r} of tag {doc['tag']!r} is incremental on {d['tag']!r}, "
                    "which has no such table"
                )
        out[s] = links[::-1]
    return out


def _join_rows(blocks: Iterable[tables.Rows], capacity: int) -> tables.Rows | None:
    """Copy blocks into one set of arrays (one import call: the table grows once)."""
    out: tables.Rows | None = None
    filled = 0
    for r in blocks:
        m = r.keys.shape[0]
        if out is None:
            out = tables.Rows(*(np.empty((capacity, *a.shape[1:]), a.dtype) for a in r))
        for dst, src in zip(out, r, strict=True):
            dst[filled : filled + m] = src
        filled += m
    if out is None:
        return None
    return tables.Rows(*(a[:filled] for a in out))


def stage_table(
    store: KVStore,
    doc: dict[str, Any],
    name: str,
    shard: int | None,
    num_shards: int | None,
    on_bytes: OnBytes | None,
    saved_shard: str | None = None,
) -> tuple[list[tables.Rows | None], list[np.ndarray], bool]:
    """Read and verify the rows of a table's chain, without touching any table.

    Parameters
    ----------
    store
        The store holding the tag.
    doc
        The tag's manifest.
    name
        The table's name in the manifest.
    shard, num_shards
        Keep only the rows of shard ``shard`` of ``num_shards`` (None, None: every row).
    on_bytes
        Called with the byte count of each block read (progress), or None.
    saved_shard
        Read only the rows one shard of the save wrote (a key of the entry's ``shards``).

    Returns
    -------
    (rows, removed, is_chain)
        The blocks (zero-copy views of the records read) in the order to apply them, with a
        None where the next array of ``removed`` (the keys an incremental link removed)
        applies; and whether any saved shard has more than one link.
    """
    rows: list[tables.Rows | None] = []
    removed: list[np.ndarray] = []
    links = table_links(store, doc, name)
    if saved_shard is not None:
        links = {saved_shard: links[saved_shard]}
    is_chain = any(len(v) > 1 for v in links.values())
    for s, chain in links.items():
        for tag, ent, info in chain:
            prefix = layout.table_prefix(
                ent.get("data_tag", tag), name, int(s), ent.get("hash_tag")
            )
            what = f"table {name!r} (tag {tag!r}, shard {s})"
            sel = tables.blocks_for_shard(info["blocks"], shard, num_shards)
            blocks = tables.read_blocks(
                store, prefix, sel, what, shard, num_shards, ent.get("hash_tag"), on_bytes
            )
            rows.extend(blocks)  # zero-copy views into the records read
            if info.get("removed_pieces"):
                rk = keylists.read_key_list(
                    store, prefix, info["removed_pieces"], what, keylists.REMOVED
                )
                rows.append(None)  # marker: apply removals here
                removed.append(tables.filter_keys(rk, shard, num_shards))
    return rows, removed, is_chain


def _table_items(
    store: KVStore, doc: dict[str, Any], name: str, shard: int | None, num_shards: int | None
) -> tuple[list[bulk.Block | bulk.Removal], int]:
    """The blocks and removals of a table's chain, in order, for :func:`bulk.restore`.

    Each block gets the row positions ``pos .. pos + rows`` of the table's bulk import (in
    the order the rows are applied). Returns the items (``imp`` still unset) and the number
    of positions. The removed-key lists of incremental links are read here.
    """
    items: list[bulk.Block | bulk.Removal] = []
    pos = 0
    row_bytes = 8 + 4 * doc["tables"][name]["dim"] * 3 + 16  # as the progress total counts
    for s, chain in table_links(store, doc, name).items():
        for tag, ent, info in chain:
            hash_tag = ent.get("hash_tag")
            prefix = layout.table_prefix(ent.get("data_tag", tag), name, int(s), hash_tag)
            what = f"table {name!r} (tag {tag!r}, shard {s})"
            for b, filt in tables.blocks_for_shard(info["blocks"], shard, num_shards):
                items.append(bulk.Block(
                    None, name, layout.block_key(prefix, b[1], b[0], hash_tag), pos, b[2], filt,
                    shard, num_shards, f"{what} block {b[1]}", b[2] * row_bytes,
                ))
                pos += b[2]
            if info.get("removed_pieces"):
                rk = keylists.read_key_list(
                    store, prefix, info["removed_pieces"], what, keylists.REMOVED
                )
                items.append(bulk.Removal(None, tables.filter_keys(rk, shard, num_shards)))
    return items, pos


def _import(table: Table, pending: list[tables.Rows], presized: bool) -> None:
    """Import staged rows so that the table grows at most once.

    A table built with room for every row, and a tiered table, import block by block;
    otherwise the table's ``reserve`` is used where it has one, else the blocks are joined
    into one import.
    """
    reserve = getattr(table, "reserve", None)
    if presized or len(pending) == 1 or getattr(table, "storage", None) is not None:
        # a tiered table (storage tiers) streams the rows through its small tier 0 into the
        # lower tiers: reserving tier 0 for every row would allocate what tiering avoids
        table.import_(pending)
    elif reserve is not None:
        reserve(len(table) + sum(r.keys.shape[0] for r in pending))
        table.import_(pending)
    else:
        joined = _join_rows(iter(pending), sum(r.keys.shape[0] for r in pending))
        table.import_([joined])


def _apply_rows(
    table: Table, rows: list[tables.Rows | None], removed: list[np.ndarray], presized: bool = False
) -> None:
    """Import staged rows into ``table`` in order, applying removals at their markers."""
    pending: list[tables.Rows] = []
    it = iter(removed)
    for r in rows:
        if r is None:
            if pending:
                _import(table, pending, presized)
                pending = []
            rk = next(it)
            if len(rk):
                table.remove(rk)
        else:
            pending.append(r)
    if pending:
        _import(table, pending, presized)


def _table_class() -> Any:
    """The table class restores build (imported on first use: it loads numba)."""
    from tensorkv.embedding.table import EmbeddingTable

    return EmbeddingTable


def build_table(
    meta: dict[str, Any], rows: list[tables.Rows | None], removed: list[np.ndarray]
) -> Any:
    """A new EmbeddingTable holding staged rows.

    Parameters
    ----------
    meta
        The table's ``state_dict_meta()`` as saved in the manifest.
    rows, removed
        The rows and removed keys :func:`stage_table` returns, applied in order.

    Returns
    -------
    EmbeddingTable
        Built with room for every row when it may grow (its saved capacity setting kept).
    """
    EmbeddingTable = _table_class()  # noqa: N806
    n = sum(r.keys.shape[0] for r in rows if r is not None)
    cap = meta.get("capacity")
    if meta.get("growth", True) and n and (cap is None or cap < n):
        # Allocate the rows up front (lazily zeroed pages) instead of growing the arena,
        # which would zero-fill and copy; the table keeps its saved capacity setting.
        t = EmbeddingTable.from_meta({**meta, "capacity": n})
        if hasattr(t, "capacity_limit"):
            t.capacity_limit = cap
        presized = True
    else:
        t = EmbeddingTable.from_meta(meta)
        presized = False
    _apply_rows(t, rows, removed, presized)
    return t


def _table_dim(table: Table) -> int:
    dim = getattr(table, "dim", None)
    if dim is None:
        dim = table.state_dict_meta()["dim"]
    return int(dim)


def _check_slots(name: str, table: Table, rows: list[tables.Rows | None]) -> None:
    nslots = getattr(table, "num_slots", None)
    if nslots is None:
        return
    want = int(nslots) * _table_dim(table)
    for r in rows:
        if r is not None and r.slots.shape[1] != want:
            opt = getattr(getattr(table, "optimizer", None), "name", "?")
            raise ShapeError(
                f"table {name!r}: the checkpoint stores {r.slots.shape[1]} optimizer slot "
                f"columns per row but the target's optimizer {opt!r} uses {want}; build the "
                "target with the optimizer it was saved with"
            )


def _check_room(name: str, table: Table, rows: list[tables.Rows | None] | int) -> None:
    limit = getattr(table, "capacity_limit", None)
    if limit is None or getattr(table, "growth", True):
        return
    n = rows if isinstance(rows, int) else sum(  # an upper bound
        r.keys.shape[0] for r in rows if r is not None)
    if n > limit:
        raise CapacityError(
            f"table {name!r}: the checkpoint holds up to {n} rows but the target table may "
            f"hold at most capacity={limit} (growth=False); build it with a larger capacity"
        )


def restore_meta(table: Table, meta: dict[str, Any]) -> None:
    """Restore the table-global state (optimizer state such as Adam's step, the table step)."""
    fn = getattr(table, "load_state_meta", None)
    if fn is not None:
        fn(meta)
        return
    opt_state = (meta.get("optimizer") or {}).get("state")
    opt = getattr(table, "optimizer", None)
    if opt_state is not None and opt is not None and hasattr(opt, "load_state"):
        opt.load_state(opt_state)
    if "step" in meta:
        table.step = int(meta["step"])


def _select(
    doc: dict[str, Any], kind: str | None, dense_t: dict[str, Any], tables_t: dict[str, Any],
    variables: list[str] | None, partial: bool = False,
) -> tuple[list[str], list[str]]:
    stored_dense, stored_tables = set(doc["dense"]), set(doc["tables"])
    avail = sorted(stored_dense | stored_tables)
    if kind == "dict" and variables is None and not partial:
        absent = [n for n in [*dense_t, *tables_t] if n not in stored_dense | stored_tables]
        if absent:
            raise CheckpointError(
                f"the target dict has {absent}, which tag {doc['tag']!r} does not hold; it "
                f"holds {avail}. Pass partial=True to load what the tag holds and leave "
                "the rest of the dict as it is, or variables=[...] to choose names"
            )
    if variables is not None:
        if isinstance(variables, str):
            variables = [variables]
        names = list(variables)
    elif kind in (None, "dict"):
        names = avail
    else:
        names = list(dense_t) + list(tables_t)
    missing = [n for n in names if n not in stored_dense and n not in stored_tables]
    if missing:
        raise CheckpointError(
            f"tag {doc['tag']!r} does not hold {missing}; it holds {avail} "
            "(restore a subset with variables=[...])"
        )
    return [n for n in names if n in stored_dense], [n for n in names if n in stored_tables]


def load(
    obj: Any,
    url: str | KVStore,
    tag: str = "latest",
    *,
    variables: list[str] | None = None,
    shard: int | None = None,
    num_shards: int | None = None,
    progress: bool | None = None,
    partial: bool = False,
) -> Any:
    """Load a tag into ``obj`` (or return the stored objects when ``obj`` is None).

    Everything is read and verified (checksums, shapes, dtypes, table dims) before the
    target is touched, so a failed load leaves ``obj`` unchanged.

    Parameters
    ----------
    obj
        None, a dict of numpy arrays / torch tensors / EmbeddingTables, an EmbeddingTable, or
        a torch ``nn.Module`` (the same shapes of object :func:`tensorkv.save` takes). A table
        with a ``load_sharded`` method (a ``ShardedEmbeddingTable``) loaded alone from a URL
        has each of its shards read its own rows.
    url
        Store URL or open KVStore.
    tag
        Tag name, or ``"latest"`` (the newest visible tag).
    variables
        Restore only these names (tensor or table names as saved).
    shard, num_shards
        Restore only the table rows that belong to shard ``shard`` of ``num_shards`` under the
        stable hash (``splitmix64``, see docs/format.md), whatever number of shards saved them.
        Dense tensors are restored whole.
    progress
        Progress bar: None (auto), True or False.
    partial
        Loading into a dict refuses a dict that holds names the tag does not (they would be
        left stale without a word); ``partial=True`` loads what the tag holds and leaves those
        entries as they are.

    Returns
    -------
    object
        ``obj`` itself, or (when ``obj`` is None) a dict name -> numpy array / EmbeddingTable.
    """
    sharded = getattr(obj, "load_sharded", None)  # a table whose shards load themselves
    if sharded is not None and isinstance(url, str) and shard is None and variables is None:
        sharded(url, tag)
        return obj
    if (shard is None) != (num_shards is None):
        raise CheckpointError(f"shard={shard!r}, num_shards={num_shards!r}: give both or neither")
    if num_shards is not None and (
        not isinstance(num_shards, int)
        or num_shards < 1
        or not (isinstance(shard, int) and 0 <= shard < num_shards)
    ):
        raise CheckpointError(
            f"shard={shard!r} must be an int in [0, num_shards={num_shards!r})"
        )
    kind, dense_t, tables_t = (None, {}, {}) if obj is None else collect(obj)
    with using_store(url, create=False) as store:
        doc = manifest.read(store, tag)
        if kind == "table" and SINGLE_TABLE_NAME not in doc["tables"] and len(doc["tables"]) == 1:
            tables_t = {next(iter(doc["tables"])): tables_t[SINGLE_TABLE_NAME]}
        dnames, tnames = _select(doc, kind, dense_t, tables_t, variables, partial)
        # --- checks that need no data
        for n in dnames:
            if n in tables_t:
                raise CheckpointError(
                    f"{n!r} is a dense tensor in the checkpoint but a table in the target"
                )
            if n in dense_t:
                tgt = dense_t[n]
                arr_like = dense.to_numpy(n, tgt)[0]
                dense.check_against(n, doc["dense"][n], arr_like)
        for n in tnames:
            if n in dense_t:
                raise CheckpointError(
                    f"{n!r} is a table in the checkpoint but a tensor in the target"
                )
            if kind is not None and kind != "dict" and n not in tables_t:
                raise CheckpointError(f"table {n!r} has no counterpart in the target object")
            if n in tables_t:
                sd, td = doc["tables"][n]["dim"], _table_dim(tables_t[n])
                if sd != td:
                    raise ShapeError(
                        f"table {n!r}: the checkpoint has dim {sd} but the target table has dim "
                        f"{td}; build the table with dim={sd} or load with load(None, ...)"
                    )
        total = sum(doc["dense"][n]["nbytes"] for n in dnames)
        total += sum(
            sum(b[2] for info in doc["tables"][n]["shards"].values() for b in info["blocks"])
            * (8 + 4 * doc["tables"][n]["dim"] * 3 + 16)
            for n in tnames
        )
        # Tables restored by a bulk import (new tables, and targets that support it) and the
        # dense tensors are read, verified and copied in one pass (checkpoint/bulk.py); other
        # targets (tiered tables) get staged rows and import_ them.
        for n in tnames:  # a table whose rows the tag does not hold must still have them
            check = getattr(tables_t.get(n), "check_restore_meta", None)
            if check is not None:
                check(doc["tables"][n]["meta"])
        fast = [n for n in tnames if n not in tables_t or
                getattr(tables_t[n], "can_bulk_import", False)]
        slow = [n for n in tnames if n not in fast]
        items: list[bulk.Item] = []
        staged_dense: dict[str, np.ndarray] = {}
        pages = FreshPages()  # base pages for the new dense arrays
        for n in dnames:
            staged_dense[n], chunks = bulk.dense_items(n, doc["dense"][n], pages)
            items.extend(chunks)
        imports: dict[str, Any] = {}
        for n in fast:
            table_items, positions = _table_items(store, doc, n, shard, num_shards)
            if n in tables_t:
                table = tables_t[n]
                _check_room(n, table, positions)
            else:
                table = _table_class().from_meta(doc["tables"][n]["meta"])
            imports[n] = imp = table.bulk_import(positions)
            for it in table_items:
                it.imp = imp
            items.extend(table_items)
        pbar = bar(total, f"load {doc['tag']}", progress)
        try:
            bulk.restore(store, items, pbar.update)
            staged_tables = {
                n: stage_table(store, doc, n, shard, num_shards, pbar.update) for n in slow
            }
        finally:
            pbar.close()
            pages.release()
        del items
        for n, (rows, _, _) in staged_tables.items():
            _check_slots(n, tables_t[n], rows)
            _check_room(n, tables_t[n], rows)
        # --- everything is verified: build or assign
        if obj is None:
            out: dict[str, Any] = dict(staged_dense)
            for n in tnames:
                imports[n].commit()
                out[n] = imports[n].table
            return out
        built = {}
        for n, (rows, removed, is_chain) in staged_tables.items():
            if is_chain:
                built[n] = build_table(doc["tables"][n]["meta"], rows, removed)
        for n in fast:
            imports[n].commit()
        for n, arr in staged_dense.items():
            _assign_dense(obj, kind, dense_t, n, arr, doc["dense"][n].get("torch_dtype"))
        for n in tnames:
            if n not in tables_t:
                obj[n] = imports[n].table
                continue
            target = tables_t[n]
            if n in staged_tables and getattr(target, "rows_in_checkpoint", True):
                rows, removed, _is_chain = staged_tables[n]
                old = np.asarray(target.keys())
                if len(old):
                    target.remove(old)
                if n in built:
                    target.import_(built[n].export())
                else:
                    _apply_rows(target, rows, removed)
            restore_meta(target, doc["tables"][n]["meta"])
            info = doc["tables"][n]["shards"]
            if shard is None and len(info) == 1:
                only = next(iter(info.values()))
                sid = only.get("state")
                if sid:
                    tables.known_states(target)[sid] = tables.table_seq(target)
        return obj


def _assign_dense(obj: Any, kind: str | None, dense_t: dict[str, Any], name: str,
                  arr: np.ndarray, torch_dtype: str | None) -> None:
    tgt = dense_t.get(name)
    if tgt is None:
        obj[name] = arr
        return
    if dense.is_torch_tensor(tgt):
        import torch

        with torch.no_grad():
            tgt.copy_(dense.to_torch(arr, torch_dtype))
        return
    if isinstance(tgt, np.ndarray) and tgt.flags.writeable:
        np.copyto(tgt, arr)
    else:
        obj[name] = arr


def read_tensor(url: str | KVStore, tag: str, name: str, index: Any = None) -> np.ndarray:
    """Read one dense tensor, or ``tensor[index]``, fetching only the chunks it needs.

    Parameters
    ----------
    url
        Store URL or open KVStore.
    tag
        Tag name or ``"latest"``.
    name
        Tensor name as saved.
    index
        None (the whole tensor) or a basic index: ints, slices, ``None`` and ``...``; only
        the chunks holding the rows of axis 0 it selects are read.
    """
    with using_store(url, create=False) as store:
        doc = manifest.read(store, tag)
        ent = doc["dense"].get(name)
        if ent is None:
            where = " (it is an embedding table: use load(None, url, tag, variables=[...]))" if (
                name in doc["tables"]) else ""
            raise CheckpointError(
                f"tag {doc['tag']!r} has no dense tensor {name!r}{where}; it has "
                f"{sorted(doc['dense'])}"
            )
        if index is None:
            return dense.read_full(store, name, ent)
        return dense.read_slice(store, name, ent, index)
