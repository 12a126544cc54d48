"""A dynamic module's table inside the model's ``state_dict()`` (its ``_extra_state`` entry).

``model.state_dict()`` holds, for each dynamic module, a dict with the table's rows as
tensors (keys, values, optimizer slots, frequencies, versions) and its metadata (step,
optimizer state): ``torch.save(model.state_dict(), f)`` and ``model.load_state_dict(...)``
round-trip a model as they do for ``nn.Embedding``, and frameworks that checkpoint through
``state_dict()`` keep the tables. The dict is a copy of every row in memory: a table larger
than memory is saved with :func:`tensorkv.save`, which stores the rows as records instead
(it collects the dense state without them). See docs/torch.md ("Checkpoints").
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tensorkv.checkpoint.load import restore_meta
from tensorkv.checkpoint.objects import TABLE_STATE, collecting_module_state
from tensorkv.embedding.chunks import ExportChunk, check_chunk, nonfinite_rows
from tensorkv.embedding.optimizers import get_optimizer
from tensorkv.embedding.protocol import Table
from tensorkv.errors import CheckpointError

#: Version of the dict's layout.
FORMAT = 1
_FIELDS = ("keys", "values", "slots", "freq", "version")


def table_state(table: Table) -> dict[str, Any]:
    """The dict a module's ``state_dict()`` holds for ``table`` (a marker while collecting)."""
    if collecting_module_state():
        return {TABLE_STATE: 0}
    chunks = list(table.export())
    meta = table.state_dict_meta()
    dim, width = int(meta["dim"]), _slot_width(meta)
    parts: dict[str, list[np.ndarray]] = {f: [] for f in _FIELDS}
    for ch in chunks:
        for f in _FIELDS:
            x = np.asarray(getattr(ch, f))
            parts[f].append(x.astype(np.float32) if f == "values" else x)
    empty = {"keys": np.empty(0, np.int64), "values": np.empty((0, dim), np.float32),
             "slots": np.empty((0, width), np.float32), "freq": np.empty(0, np.int64),
             "version": np.empty(0, np.int64)}
    out: dict[str, Any] = {TABLE_STATE: FORMAT, "meta": meta}
    for f in _FIELDS:
        arr = np.concatenate(parts[f]) if parts[f] else empty[f]
        out[f] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def _slot_width(meta: dict[str, Any]) -> int:
    """Optimizer slot columns of a table's rows, from its ``state_dict_meta()``."""
    config = (meta.get("optimizer") or {}).get("config")
    return get_optimizer(config).num_slots * int(meta["dim"])


def load_table_state(table: Table, state: Any, name: str) -> None:
    """Replace ``table``'s rows and step with ``state`` (from :func:`table_state`).

    Everything is checked before the table changes: a bad state raises
    :class:`~tensorkv.errors.CheckpointError` (or the table's own error for non-finite rows)
    and leaves the table as it was.
    """
    if not isinstance(state, dict) or TABLE_STATE not in state:
        raise CheckpointError(f"{name}: the state_dict entry is not a tensorkv table's state "
                              "(a dict made by a dynamic module's state_dict())")
    if state[TABLE_STATE] == 0:
        raise CheckpointError(f"{name}: the state_dict holds a placeholder, not the table's "
                              "rows (it was collected by tensorkv.save, which stores the rows "
                              "in the store); load that checkpoint with tensorkv.load")
    if state[TABLE_STATE] != FORMAT:
        raise CheckpointError(f"{name}: table state format {state[TABLE_STATE]!r} is not "
                              f"{FORMAT}; save it again with this tensorkv")
    meta = state.get("meta") or {}
    if int(meta.get("dim", -1)) != table.dim:
        raise CheckpointError(f"{name}: the state holds rows of dim {meta.get('dim')} but the "
                              f"module's table has dim {table.dim}")
    try:
        arrays = [np.asarray(state[f].numpy() if isinstance(state[f], torch.Tensor)
                             else state[f]) for f in _FIELDS]
    except KeyError as e:
        raise CheckpointError(f"{name}: the table state lacks {e}") from None
    keys, values, slots, freq, version = arrays
    chunk = ExportChunk(keys, values, slots, freq, version, np.zeros(keys.shape[0], np.int64))
    own = table.state_dict_meta()  # any table with the table API (a sharded one too)
    arena = getattr(table, "arena", None)  # a sharded table's shards convert float32 rows
    storage = arena.np_dtype if arena is not None else np.dtype(np.float32)
    keys, values, slots, _, _ = check_chunk(
        chunk, dim=table.dim, slot_width=_slot_width(own), storage_dtype=storage,
        optimizer=str(((own.get("optimizer") or {}).get("config") or {}).get("name", "?")),
        as_keys=table.as_keys, what="load_state_dict")
    if getattr(table, "nan_policy", "raise") == "raise" and keys.size and nonfinite_rows(
            values, slots, storage).any():
        raise CheckpointError(f"{name}: the state holds rows with NaN or Inf; the table is "
                              "unchanged (create it with nan_policy='skip' to leave them out)")
    limit = getattr(table, "capacity_limit", None)
    if limit is not None and not getattr(table, "growth", True) and keys.shape[0] > limit:
        raise CheckpointError(f"{name}: the state holds {keys.shape[0]} rows but the table may "
                              f"hold at most capacity={limit} (growth=False)")
    table.clear()
    if keys.size:
        table.import_(chunk)
    restore_meta(table, meta)


def weight_rows(weight: Any, padding_idx: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Ids ``0..n-1`` (without ``padding_idx``) and their rows of an ``nn.Embedding`` weight."""
    w = weight.detach().to("cpu", torch.float32).numpy() if isinstance(weight, torch.Tensor) \
        else np.asarray(weight, np.float32)
    ids = np.arange(w.shape[0], dtype=np.int64)
    if padding_idx is not None:
        keep = ids != padding_idx
        ids, w = ids[keep], w[keep]
    return ids, w


def load_weight(table: Table, weight: Any, padding_idx: int | None, name: str) -> None:
    """Replace ``table``'s rows with an ``nn.Embedding``/``nn.EmbeddingBag`` ``weight``.

    What ``load_state_dict`` does with the ``weight`` entry of a model saved before
    :func:`~tensorkv.torch.convert` replaced the module: id ``i`` gets row ``i`` (new slots,
    no frequencies), as in ``convert``. Checked before the table changes.
    """
    shape = tuple(getattr(weight, "shape", ()))
    if len(shape) != 2 or shape[1] != table.dim:
        raise CheckpointError(f"{name}: a weight of shape {shape} does not fit a table of dim "
                              f"{table.dim}; it needs shape [num_embeddings, {table.dim}]")
    ids, rows = weight_rows(weight, padding_idx)
    if not np.isfinite(rows).all():
        raise CheckpointError(f"{name}: the weight holds NaN or Inf; the table is unchanged")
    table.clear()
    if ids.size:
        table.upsert(ids, rows)


__all__ = ["FORMAT", "load_table_state", "load_weight", "table_state", "weight_rows"]
