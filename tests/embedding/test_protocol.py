"""The Table protocol: every table satisfies it, other objects do not, and checking runs nothing."""

from __future__ import annotations

import typing

import numpy as np
import pytest

import tensorkv
from tensorkv.checkpoint.objects import is_table
from tensorkv.embedding.protocol import TABLE_MEMBERS, Table


@pytest.mark.parametrize("storage", ["DRAM", "DRAM_SSDHASH", "HBM"])
def test_every_kind_of_embedding_table_is_a_table(tmp_path, storage):
    if storage == "HBM":
        pytest.importorskip("torch")
    kw = {} if storage == "DRAM" else {"storage": storage, "storage_path": str(tmp_path),
                                       "storage_size": [64]}
    if storage == "HBM":
        kw = {"storage": "HBM", "device": "cpu"}
    with tensorkv.EmbeddingTable(4, **kw) as t:
        t.lookup(np.arange(5))
        assert isinstance(t, Table) and is_table(t)


def test_a_torch_modules_table_is_a_table():
    torch_mod = pytest.importorskip("tensorkv.torch")
    m = torch_mod.DynamicEmbedding(4)
    assert isinstance(m.table, Table)


def test_objects_without_the_whole_api_are_not_tables():
    t = tensorkv.EmbeddingTable(4)
    assert not isinstance(tensorkv.EmbeddingTable, Table)  # the class is not a table
    assert not isinstance(object(), Table)
    assert not isinstance(t.snapshot(), Table)  # exports, but cannot be written to

    class AlmostATable:
        pass

    for name in TABLE_MEMBERS[1:]:  # every member but ``dim``
        setattr(AlmostATable, name, None)
    almost = AlmostATable()
    assert not isinstance(almost, Table)
    almost.dim = 4  # an instance attribute counts
    assert isinstance(almost, Table)


def test_the_members_checked_are_the_protocols():
    assert set(TABLE_MEMBERS) == set(typing._get_protocol_attrs(Table))


def test_recognising_a_table_runs_none_of_its_properties():
    """A sharded table's ``step`` and ``mutation_seq`` call its shards: never on isinstance."""
    calls = []

    class Remote(tensorkv.EmbeddingTable):
        @property
        def step(self):
            calls.append("step")
            raise ConnectionError("the shards are gone")

        @property
        def mutation_seq(self):
            calls.append("mutation_seq")
            raise ConnectionError("the shards are gone")

    assert isinstance(Remote(4), Table) and calls == []


def test_a_torch_module_refuses_a_table_that_is_not_one():
    torch_mod = pytest.importorskip("tensorkv.torch")
    with pytest.raises(tensorkv.errors.ConfigError, match="table=dict must be a tensorkv"):
        torch_mod.DynamicEmbedding(4, table={"lookup": None})


def test_every_row_backend_implements_the_row_backend_interface(tmp_path):
    from tensorkv.embedding.backend import RowBackend
    from tensorkv.embedding.redis.rows import RedisBackend

    with tensorkv.EmbeddingTable(4) as dram, tensorkv.EmbeddingTable(
            4, storage="DRAM_SSDHASH", storage_path=str(tmp_path), storage_size=[64]) as tiered:
        assert isinstance(dram._rows, RowBackend) and isinstance(tiered._rows, RowBackend)
    assert issubclass(RedisBackend, RowBackend)

    class Partial(RowBackend):  # a backend that leaves hooks out cannot be made
        def begin_write(self, table, what, *args):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()
