"""Parameter server on Ray: embedding tables sharded over actors (docs/distributed.md).

:class:`ParameterServer` starts (or attaches to) shard actors, each holding an
:class:`~tensorkv.EmbeddingTable` per table; :meth:`ParameterServer.table` returns a
:class:`ShardedEmbeddingTable` with the EmbeddingTable API. Changes over several shards are
all or nothing (:mod:`tensorkv.distributed.ops`). :func:`start_local_ray` starts a Ray that
listens on the loopback address only. Ray is imported on first use
(``pip install "tensorkv[ray]"``).
"""

from tensorkv.distributed.local import start_local_ray
from tensorkv.distributed.server import ParameterServer
from tensorkv.distributed.table import ShardedEmbeddingTable

__all__ = ["ParameterServer", "ShardedEmbeddingTable", "start_local_ray"]
