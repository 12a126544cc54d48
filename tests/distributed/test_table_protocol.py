"""A sharded table is a :class:`~tensorkv.embedding.protocol.Table`, as the local one is."""

import numpy as np

from tensorkv.checkpoint.objects import is_table
from tensorkv.embedding.protocol import Table


def test_a_sharded_table_is_a_table(ps, table_names):
    t = ps.table(next(table_names), 4)
    t.lookup(np.arange(3))
    assert isinstance(t, Table) and is_table(t)
