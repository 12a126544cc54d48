"""Checkpoints: whole models saved into a KVStore as tags.

The layout of a checkpoint in the store (keys, manifests, blocks, key lists, dump files) is
described in ``docs/format.md``. The modules import one another in this order only (each
imports only modules listed before it):

- ``layout``, ``gather``, ``progress``, ``access``: key names and the stable hash, numba
  kernels, progress bars, opening stores;
- ``manifest``, ``dense``, ``keylists``, ``staging``, ``runs``: manifests, dense chunks,
  table key lists, shards written into LevelDB/RocksDB through a stage in turns, the run
  record of a sharded save;
- ``writer``: the record writer (:class:`~tensorkv.checkpoint.writer.BlockWriter`);
- ``objects``, ``shards``, ``tables``: what can be saved, combining a run's shard
  manifests, table blocks;
- ``refs``, ``bulk``, ``sweep``: what a tag references and owns, the restore pipeline,
  sharded saves left behind (listed, removed, verified);
- ``steps``, ``handle``: training-step scopes, saves in flight;
- ``save``, ``load``;
- ``tags`` (list, delete, copy, compact, dump and import), then ``check`` (check, gc).

Tables come in as :class:`~tensorkv.embedding.protocol.Table` objects. The stable key hash
and the shard of a key (:func:`tensorkv.checkpoint.layout.shard_of_keys`)
are in ``layout``.
"""

from tensorkv.checkpoint.check import CheckReport, check, gc
from tensorkv.checkpoint.handle import SaveHandle
from tensorkv.checkpoint.load import load, read_tensor
from tensorkv.checkpoint.save import save
from tensorkv.checkpoint.shards import merge
from tensorkv.checkpoint.steps import StepScope, training_step
from tensorkv.checkpoint.tags import (
    compact,
    copy_tag,
    delete_tag,
    dump_tag,
    expire_tag,
    import_dump,
    latest_tag,
    list_tags,
    tag_manifest,
)

__all__ = [
    "CheckReport",
    "SaveHandle",
    "StepScope",
    "check",
    "compact",
    "copy_tag",
    "delete_tag",
    "dump_tag",
    "expire_tag",
    "gc",
    "latest_tag",
    "list_tags",
    "load",
    "merge",
    "read_tensor",
    "import_dump",
    "save",
    "tag_manifest",
    "training_step",
]

#: Old names kept importable for one release: old name -> new name. Each access warns.
RENAMED = {"restore_tag": "import_dump", "tag_info": "tag_manifest"}


def __getattr__(name: str) -> object:
    if name in RENAMED:
        import warnings

        new = RENAMED[name]
        warnings.warn(f"tensorkv.checkpoint.{name} is deprecated and will be removed in the next "
                      f"release; use tensorkv.checkpoint.{new}", DeprecationWarning, stacklevel=2)
        return globals()[new]
    raise AttributeError(f"module 'tensorkv.checkpoint' has no attribute {name!r}")
