"""Entry points shaped like the systems tensorkv's users come from (docs/coming_from.md).

:mod:`tensorkv.compat.tfra`: TFRA's ``RedisTableConfig``/``RedisTableCreator`` pair.
DeepRec's storage-type names and ``TF_*`` variables, and TFRA's config keys, need no
wrapper: :class:`~tensorkv.StorageOption` and :mod:`tensorkv.config` take them as they are.
"""
