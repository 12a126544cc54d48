"""What can be saved: dicts of arrays/tensors, EmbeddingTables, nn.Modules, and mixes.

:func:`collect` splits such an object into dense tensors and tables by name; the manifest
records which kind it was (the ``kind`` field in ``docs/format.md``).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeGuard

import numpy as np

from tensorkv.checkpoint import layout
from tensorkv.checkpoint.dense import is_torch_tensor
from tensorkv.embedding.protocol import Table
from tensorkv.errors import CheckpointError

SINGLE_TABLE_NAME = "table"
#: Key of the dict a dynamic module puts into its ``state_dict()`` for its table.
TABLE_STATE = "tensorkv_table"
#: Its tensors, and the name suffix of its JSON part once spread (:func:`spread_tables`).
TABLE_FIELDS = ("keys", "values", "slots", "freq", "version")
_META = "/meta"
_local = threading.local()


def is_table(x: Any) -> TypeGuard[Table]:
    """Whether ``x`` is an embedding table (a :class:`~tensorkv.embedding.protocol.Table`)."""
    return isinstance(x, Table)


def is_module(x: Any) -> bool:
    """Whether ``x`` is a torch nn.Module (without importing torch)."""
    return any(
        c.__module__.startswith("torch.nn") and c.__name__ == "Module" for c in type(x).__mro__
    )


def module_tables(module: Any) -> dict[str, Any]:
    """EmbeddingTables held as attributes anywhere in a module tree, by dotted name."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for mod_name, mod in module.named_modules():
        for attr, val in vars(mod).items():
            if attr.startswith("__") or not is_table(val) or id(val) in seen:
                continue
            seen.add(id(val))
            out[f"{mod_name}.{attr}" if mod_name else attr] = val
    return out


def collecting_module_state() -> bool:
    """Whether :func:`module_state` is collecting a module's dense state in this thread.

    A dynamic module then leaves its table's rows out of its ``state_dict()`` (a marker
    instead): a checkpoint stores the table itself, as records.
    """
    return bool(getattr(_local, "depth", 0))


@contextlib.contextmanager
def _collecting() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def module_state(module: Any) -> dict[str, Any]:
    """A module's ``state_dict()`` without the tables its dynamic modules hold."""
    with _collecting():
        state = dict(module.state_dict())
    return {k: v for k, v in state.items() if not (isinstance(v, dict) and TABLE_STATE in v)}


def spread_tables(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with each table dict of a dynamic module spread into tensors.

    The dict under ``name`` becomes ``name/keys``, ``name/values``, ``name/slots``,
    ``name/freq``, ``name/version`` and ``name/meta`` (its JSON part as uint8), so that a
    store of plain tensors keeps it; :func:`gather_tables` puts it back together.
    """
    out: dict[str, Any] = {}
    for name, val in state.items():
        if not (isinstance(val, dict) and TABLE_STATE in val):
            out[name] = val
            continue
        if not val[TABLE_STATE]:
            raise CheckpointError(f"{name!r} is a placeholder for a table's rows, not the rows")
        for f in TABLE_FIELDS:
            out[f"{name}/{f}"] = val[f]
        doc = json.dumps({TABLE_STATE: val[TABLE_STATE], "meta": val["meta"]})
        out[name + _META] = np.frombuffer(doc.encode(), np.uint8)
    return out


def gather_tables(state: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`spread_tables` (other entries pass through)."""
    out = dict(state)
    for key in [k for k in state if k.endswith(_META)]:
        name = key[: -len(_META)]
        if not all(f"{name}/{f}" in state for f in TABLE_FIELDS):
            continue
        raw = out.pop(key)
        raw = raw.numpy() if hasattr(raw, "numpy") else raw  # a torch tensor or an array
        table = json.loads(np.asarray(raw, np.uint8).tobytes())
        for f in TABLE_FIELDS:
            table[f] = out.pop(f"{name}/{f}")
        out[name] = table
    return out


def collect(obj: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Split ``obj`` into (kind, dense tensors by name, tables by name)."""
    kind, tables, dense_fn = collect_parts(obj)
    dense, _ = dense_fn()
    clash = sorted(set(dense) & set(tables))
    if clash:
        raise CheckpointError(f"names {clash} are both module state and embedding tables")
    return kind, dense, tables


def collect_parts(
    obj: Any,
) -> tuple[str, dict[str, Any], Callable[[], tuple[dict[str, Any], None]]]:
    """Split ``obj`` into (kind, tables by name, a function returning its dense tensors).

    A save calls the function inside its snapshot's barrier: a module's ``state_dict()`` is
    read there (the second item it returns, extra metadata, is None here).
    """
    if is_table(obj):
        return "table", {SINGLE_TABLE_NAME: obj}, lambda: ({}, None)
    if is_module(obj):
        return "module", module_tables(obj), lambda: (module_state(obj), None)
    kind, dense, tables = _collect_dict(obj)
    return kind, tables, lambda: (dense, None)


def _collect_dict(obj: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    if isinstance(obj, dict):
        dense, tables = {}, {}
        for name, val in obj.items():
            layout.check_var_name(name)
            if is_table(val):
                tables[name] = val
            elif is_torch_tensor(val) or hasattr(val, "__array__") or hasattr(val, "dtype"):
                dense[name] = val
            else:
                raise CheckpointError(
                    f"variable {name!r} has type {type(val).__name__}; dict values must be numpy "
                    "arrays, torch tensors or EmbeddingTables"
                )
        return "dict", dense, tables
    raise CheckpointError(
        f"cannot save a {type(obj).__name__}; pass a dict of numpy arrays / torch tensors / "
        "EmbeddingTables, an EmbeddingTable, or a torch nn.Module"
    )
