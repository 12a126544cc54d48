"""ShardedEmbeddingTable passes the EmbeddingTable conformance suite, bit for bit.

Every operation goes through a 2-shard parameter server on a local Ray; the reference is a
single-process DRAM EmbeddingTable. ``mutation_seq`` is left out of the comparisons: each
shard counts its own changes, so neither the table's counter nor the rows' change numbers
can equal the reference's single counter (they grow with every change all the same).
"""

from typing import Any

import pytest

from tensorkv.testing import TableTests


class TestShardedTable(TableTests):
    random_seeds = (0, 1)
    random_ops = 120

    @pytest.fixture
    def make_table(self, ps, table_names):
        made = []

        def make(dim: int, **kw: Any):
            name = next(table_names)
            made.append(name)
            return ps.table(name, dim, **kw)

        yield make
        for name in made:
            ps.drop_table(name)

    def same(self, table: Any, ref: Any, **kwargs: Any) -> None:
        kwargs["seq"] = False
        super().same(table, ref, **kwargs)

