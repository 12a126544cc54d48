"""Checkpoints: whole models saved into a KVStore as tags (see docs/format.md)."""

from tensorkv.checkpoint.check import CheckReport, check, gc
from tensorkv.checkpoint.layout import shard_of_keys, splitmix64
from tensorkv.checkpoint.load import load, read_tensor
from tensorkv.checkpoint.save import save
from tensorkv.checkpoint.shards import merge
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
    "shard_of_keys",
    "splitmix64",
    "tag_info",
]
