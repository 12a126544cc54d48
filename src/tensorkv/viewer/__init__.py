"""Read-only inspection of checkpoints: the query layer under ``tensorkv ls/show/search/...``.

Every query works on a tag of a store at any URL and streams table rows in chunks, so a
10M-row table is never loaded whole. The modules, lowest first:

- ``catalog``: :class:`Catalog` (an open store): tags, a tag's variables, the latest tag,
  dense slices; unknown names raise errors that list what exists;
- ``rows``: :class:`TableView`, one table of one tag: rows in chunks, pages by offset, rows
  of given keys, key ranges, samples;
- ``where``: the predicate language of ``--where`` (``freq >= 10 and norm < 0.1``), parsed by
  a small recursive-descent parser (never ``eval``) into vectorised numpy masks;
- ``search``: keys, key ranges, predicates, exact nearest neighbours (cosine, l2, dot);
- ``stats``: counts, histograms of norm / frequency / version, non-finite and never-updated
  rows;
- ``diff``: what changed between two tags;
- ``export``: a variable to ``.npz``, ``.safetensors``, ``.parquet`` or ``.csv``.

Examples
--------
>>> import numpy as np, tensorkv
>>> from tensorkv.viewer import Catalog
>>> t = tensorkv.EmbeddingTable(4)
>>> _ = t.lookup(np.arange(10))
>>> _ = tensorkv.save({"emb": t, "w": np.ones((3, 2), np.float32)}, "memory://viewer-doc", "v1")
>>> with Catalog("memory://viewer-doc") as cat:
...     [(v.name, v.kind, v.rows) for v in cat.variables()]
[('emb', 'table', 10), ('w', 'dense', None)]
"""

from tensorkv.viewer.catalog import Catalog, TagInfo, VariableInfo, parse_index
from tensorkv.viewer.rows import Chunk, TableView
from tensorkv.viewer.where import Predicate, parse_predicate

__all__ = [
    "Catalog",
    "Chunk",
    "Predicate",
    "TableView",
    "TagInfo",
    "VariableInfo",
    "parse_index",
    "parse_predicate",
]
