"""Parameter server on Ray: embedding tables sharded over actors (docs/distributed.md).

:class:`ParameterServer` starts (or attaches to) shard actors, each holding an
:class:`~tensorkv.EmbeddingTable` per table; :meth:`ParameterServer.table` returns a
:class:`ShardedEmbeddingTable` with the EmbeddingTable API. Ray is imported on first use
(``pip install "tensorkv[ray]"``).
"""

from tensorkv.distributed.server import ParameterServer
from tensorkv.distributed.table import ShardedEmbeddingTable

__all__ = ["ParameterServer", "ShardedEmbeddingTable"]
