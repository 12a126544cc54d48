"""Helpers of the Redis-resident table tests."""

from __future__ import annotations

import tensorkv


def redis_table(url: str, dim: int, *, table_kwargs: dict | None = None,
                **options) -> tensorkv.EmbeddingTable:
    """``EmbeddingTable(dim, storage=StorageOption("REDIS", url, redis_options=options))``."""
    opt = tensorkv.StorageOption("REDIS", storage_path=url, redis_options=options)
    return tensorkv.EmbeddingTable(dim, storage=opt, **(table_kwargs or {}))
