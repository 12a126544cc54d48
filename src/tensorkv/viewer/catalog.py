"""What a store holds: tags, a tag's variables, the latest tag, dense slices.

A :class:`Catalog` keeps one store open (read-only) for many queries; manifests are cached for
``max_age`` seconds (a web server's requests reuse them, a command sees fresh ones). Unknown
tags and variables raise :class:`~tensorkv.errors.TagNotFoundError` and
:class:`~tensorkv.errors.VariableNotFoundError` whose messages list what exists.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tensorkv.checkpoint import manifest, read_tensor
from tensorkv.errors import QueryError, TagNotFoundError, VariableNotFoundError
from tensorkv.stores.base import KVStore
from tensorkv.viewer.limits import (
    MAX_SLICE_CHARS,
    SHOWN_CHARS,
    check_length,
    check_name,
    check_tag,
    shown,
)
from tensorkv.viewer.rows import TableView, row_bytes, slot_columns, table_rows_at

#: Seconds a Catalog reuses the manifests it read.
DEFAULT_MAX_AGE = 5.0



@dataclass(frozen=True)
class TagInfo:
    """One tag: what ``tensorkv ls URL`` prints per line.

    Attributes
    ----------
    tag, step, created, expires, parent
        As in the manifest (``created``/``expires`` in seconds since the epoch, UTC).
    incremental
        Whether the tag stores only what changed since ``parent``.
    dense, tables
        Number of dense tensors and of embedding tables.
    dense_bytes, table_rows, table_bytes
        Bytes of the dense tensors; rows of the tables at this tag and their bytes
        (keys, values, optimizer slots, frequency and version).
    """

    tag: str
    step: int | None
    created: float | None
    expires: float | None
    parent: str | None
    incremental: bool
    dense: int
    tables: int
    dense_bytes: int
    table_rows: int
    table_bytes: int

    @property
    def nbytes(self) -> int:
        """Bytes of every variable of the tag."""
        return self.dense_bytes + self.table_bytes

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with ``bytes``)."""
        return {**asdict(self), "bytes": self.nbytes}


@dataclass(frozen=True)
class VariableInfo:
    """One variable of a tag.

    Attributes
    ----------
    name
        The name it was saved under.
    kind
        ``"dense"`` (a tensor) or ``"table"`` (an embedding table).
    dtype
        Element type (a table's value dtype).
    shape
        Dense: the tensor's shape. Table: ``(rows, dim)``.
    rows, dim
        Table only (None for dense): row count at the tag and row width.
    nbytes
        Bytes stored for the variable at this tag (a table: every field of its rows).
    optimizer, slots
        Table only: the optimizer's name and its slot columns per row (``num_slots * dim``).
    """

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    rows: int | None = None
    dim: int | None = None
    optimizer: str | None = None
    slots: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``bytes`` for ``nbytes``)."""
        d = asdict(self)
        d["bytes"] = d.pop("nbytes")
        d["shape"] = list(self.shape)
        return d


def tag_info_of(doc: dict[str, Any]) -> TagInfo:
    """The :class:`TagInfo` of a manifest."""
    rows = {n: table_rows_at(e) for n, e in doc["tables"].items()}
    step = doc.get("step")
    return TagInfo(
        tag=doc["tag"],
        step=None if step is None else int(step),
        created=doc.get("created"),
        expires=doc.get("expires"),
        parent=doc.get("parent"),
        incremental=bool(doc.get("incremental")),
        dense=len(doc["dense"]),
        tables=len(doc["tables"]),
        dense_bytes=sum(int(e["nbytes"]) for e in doc["dense"].values()),
        table_rows=sum(rows.values()),
        table_bytes=sum(rows[n] * row_bytes(e) for n, e in doc["tables"].items()),
    )


def variable_info_of(doc: dict[str, Any], name: str) -> VariableInfo:
    """The :class:`VariableInfo` of variable ``name`` of a manifest (raises if absent)."""
    if name in doc["dense"]:
        e = doc["dense"][name]
        return VariableInfo(name, "dense", str(e["dtype"]), tuple(int(x) for x in e["shape"]),
                            int(e["nbytes"]))
    if name in doc["tables"]:
        e = doc["tables"][name]
        rows = table_rows_at(e)
        opt = (e.get("meta", {}).get("optimizer") or {}).get("config", {}).get("name")
        return VariableInfo(
            name, "table", str(e.get("meta", {}).get("dtype", "float32")), (rows, int(e["dim"])),
            rows * row_bytes(e), rows=rows, dim=int(e["dim"]), optimizer=opt,
            slots=slot_columns(e),
        )
    raise VariableNotFoundError(
        f"tag {doc['tag']!r} has no variable {shown(name)}; it has {_listing(doc)}"
    )


def _listing(doc: dict[str, Any]) -> str:
    names = [f"{n} (table)" for n in sorted(doc["tables"])]
    names += [f"{n} (dense)" for n in sorted(doc["dense"])]
    return ", ".join(names) if names else "no variables"


class Catalog:
    """An open store and the tags in it, for read-only queries.

    Parameters
    ----------
    url
        A store URL (every backend; opened read-only, never created) or an open KVStore
        (used as it is and not closed by :meth:`close`). A process that also writes to the
        same LMDB store while the catalog is open should pass its open store: LMDB lets a
        process open one environment either read-only or read-write.
    max_age
        Seconds the manifests read are reused before the store is asked again.
    release_pages
        Passed to every :class:`~tensorkv.viewer.rows.TableView`: keep the resident memory of
        scans over LMDB to one read group (for a long-running server).

    Raises
    ------
    StoreNotFoundError, StoreUnavailableError
        No store at the URL, or its server cannot be reached.
    """

    def __init__(self, url: str | KVStore, *, max_age: float = DEFAULT_MAX_AGE,
                 release_pages: bool = False):
        if isinstance(url, KVStore):
            self.store, self._owned = url, False
        else:
            from tensorkv.stores import open_store

            self.store, self._owned = open_store(url, create=False, readonly=True), True
        self.url = self.store.url
        self.max_age = float(max_age)
        self.release_pages = release_pages
        self._docs: dict[str, dict[str, Any]] | None = None
        self._read_at = 0.0

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the store if this catalog opened it."""
        if self._owned and not self.store.closed:
            self.store.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh(self) -> None:
        """Forget the cached manifests (the next query reads them again)."""
        self._docs = None

    # ------------------------------------------------------------------ tags
    def _all(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        if self._docs is None or now - self._read_at > self.max_age:
            self._docs = manifest.read_all(self.store)
            self._read_at = now
        return self._docs

    def tag_names(self) -> list[str]:
        """Visible tags, oldest first."""
        return manifest.sorted_tags(self._all())

    def tags(self) -> list[TagInfo]:
        """Every visible tag, oldest first."""
        docs = self._all()
        return [tag_info_of(docs[t]) for t in manifest.sorted_tags(docs)]

    def resolve(self, tag: str | None = None) -> str:
        """The tag's name; None or ``"latest"``: the newest tag.

        Raises
        ------
        TagNotFoundError
            No such tag (or no tag at all); the message lists the tags there are.
        """
        return str(self.manifest(tag)["tag"])

    def manifest(self, tag: str | None = None) -> dict[str, Any]:
        """The manifest of a tag (None or ``"latest"``: the newest).

        Raises
        ------
        TagNotFoundError
            No such tag; the message lists the tags there are.
        QueryError
            A name no tag can have: too long (:data:`~tensorkv.viewer.limits.MAX_TAG_BYTES`)
            or holding a character tags may not hold.
        """
        if tag is not None and tag != "latest":
            check_tag(tag)
        docs = self._all()
        if tag is None or tag == "latest":
            if not docs:
                raise TagNotFoundError(
                    f"store {self.url!r} holds no checkpoint tags; save one with tensorkv.save"
                )
            return docs[manifest.sorted_tags(docs)[-1]]
        doc = docs.get(tag)
        if doc is None:
            self.refresh()
            doc = manifest.read(self.store, tag)  # raises TagNotFoundError listing the tags
        return doc

    def tag_info(self, tag: str | None = None) -> TagInfo:
        """One tag's :class:`TagInfo`."""
        return tag_info_of(self.manifest(tag))

    # ------------------------------------------------------------------ variables
    def variables(self, tag: str | None = None) -> list[VariableInfo]:
        """The variables of a tag: tables first, then dense tensors, each by name."""
        doc = self.manifest(tag)
        names = sorted(doc["tables"]) + sorted(doc["dense"])
        return [variable_info_of(doc, n) for n in names]

    def variable(self, name: str, tag: str | None = None) -> VariableInfo:
        """One variable's :class:`VariableInfo` (the error lists the tag's variables)."""
        check_name(name)
        return variable_info_of(self.manifest(tag), name)

    def table(self, name: str, tag: str | None = None) -> TableView:
        """A :class:`~tensorkv.viewer.rows.TableView` of table ``name`` at ``tag``.

        Raises
        ------
        VariableNotFoundError
            The tag has no such variable, or it is a dense tensor (the message says which).
        QueryError
            The name is longer than :data:`~tensorkv.viewer.limits.MAX_NAME_BYTES`.
        """
        check_name(name)
        doc = self.manifest(tag)
        if name not in doc["tables"]:
            if name in doc["dense"]:
                raise VariableNotFoundError(
                    f"{name!r} of tag {doc['tag']!r} is a dense tensor, not an embedding table; "
                    f"its tables: {sorted(doc['tables']) or 'none'}"
                )
            variable_info_of(doc, name)  # raises, listing what exists
        return TableView(self.store, doc, name, release_pages=self.release_pages)

    def dense(self, name: str, tag: str | None = None, index: Any = None) -> np.ndarray:
        """A dense tensor, or ``tensor[index]`` reading only the chunks that hold it.

        ``index`` is a basic index (ints, slices, ``...``) or its text (``"0:10, :"``, see
        :func:`parse_index`).
        """
        check_name(name)
        doc = self.manifest(tag)
        if name not in doc["dense"]:
            if name in doc["tables"]:
                raise VariableNotFoundError(
                    f"{name!r} of tag {doc['tag']!r} is an embedding table, not a dense "
                    f"tensor; its dense tensors: {sorted(doc['dense']) or 'none'}"
                )
            variable_info_of(doc, name)
        if index is not None:
            text = index if isinstance(index, str) else None
            if isinstance(index, str):
                index = parse_index(index)
            index_shape(tuple(int(x) for x in doc["dense"][name]["shape"]), index, text)
        return read_tensor(self.store, doc["tag"], name, index)


_INT = r"[+-]?\d+"
_PART = re.compile(rf"^\s*(?:(?P<ellipsis>\.\.\.)|(?P<int>{_INT})|"
                   rf"(?P<start>{_INT})?\s*:\s*(?P<stop>{_INT})?\s*(?::\s*(?P<step>{_INT})?)?)\s*$")


def parse_index(text: str) -> tuple[Any, ...]:
    """Parse a numpy-style basic index: ``"0:10, :"``, ``"5"``, ``"::2, 3"``, ``"..., 0"``.

    Raises
    ------
    QueryError
        A part is not an int, a slice or ``...``; ``position`` points at it. The text is
        longer than :data:`~tensorkv.viewer.limits.MAX_SLICE_CHARS`.
    """
    check_length("slice", text, MAX_SLICE_CHARS)
    out: list[Any] = []
    pos = 0
    for part in text.split(","):
        m = _PART.match(part)
        if m is None or not part.strip():
            at = pos + len(part) - len(part.lstrip())
            raise QueryError(
                f"slice {shown(text)}: {shown(part.strip())} at character {at} is not an int, "
                "a slice such as 0:10 or ::2, or ...; write e.g. --slice '0:10, :'", text, at,
            )
        if m["ellipsis"]:
            out.append(Ellipsis)
        elif m["int"] is not None:
            out.append(int(m["int"]))
        else:
            if m["step"] is not None and int(m["step"]) == 0:
                raise QueryError(f"slice {shown(text)}: a step of 0 is not allowed", text, pos)
            start, stop, step = (None if m[g] is None else int(m[g])
                                 for g in ("start", "stop", "step"))
            out.append(slice(start, stop, step))
        pos += len(part) + 1
    return tuple(out)


def index_shape(shape: tuple[int, ...], index: Any, text: str | None = None) -> tuple[int, ...]:
    """The shape of ``tensor[index]`` for a tensor of ``shape``, found without reading it.

    Raises
    ------
    QueryError
        The index does not fit the shape (too many indices, an int out of bounds); the
        message names the index (``text`` when given), the shape and the fault.
    """
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), shape, (0,) * len(shape))
    try:
        return tuple(probe[index].shape)
    except (IndexError, TypeError, ValueError) as exc:
        label = text if text is not None else index
        if isinstance(label, str) and len(label) > SHOWN_CHARS:
            label = f"{label[:SHOWN_CHARS]}..."
        raise QueryError(f"slice [{label}] does not fit shape {list(shape)}: {exc}", text,
                         None) from None
