"""Checkpoints: whole models saved into a KVStore as tags.

The layout of a checkpoint in the store (keys, manifests, blocks, key lists, dump files) is
described in ``docs/format.md``. The modules import one another in this order only (each
imports only modules listed before it):

- ``layout``, ``gather``, ``progress``, ``access``: key names and the stable hash, numba
  kernels, progress bars, opening stores;
- ``manifest``, ``dense``, ``keylists``, ``staging``, ``runs``: manifests, dense chunks,
  table key lists, shards written into LevelDB/RocksDB through a stage in turns, the run
  record of a sharded save;
- ``objects``, ``shards``, ``tables``: what can be saved, combining a run's shard
  manifests, table blocks and the record writer;
- ``refs``, ``bulk``, ``sweep``: what a tag references and owns, the restore pipeline,
  sharded saves left behind (listed, removed, verified);
- ``steps``, ``handle``: training-step scopes, saves in flight;
- ``save``, ``load``;
- ``tags`` (list, delete, copy, compact, dump), then ``check`` (check, gc).

The stable key hash and the shard of a key (:func:`tensorkv.checkpoint.layout.shard_of_keys`)
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
    latest_tag,
    list_tags,
    restore_tag,
    tag_info,
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
    "restore_tag",
    "save",
    "tag_info",
    "training_step",
]
