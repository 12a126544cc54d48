"""TFRA's ``RedisTableConfig`` and ``RedisTableCreator``, making tensorkv tables.

A TFRA job passes ``RedisTableCreator(RedisTableConfig(...))`` as the ``kv_creator`` of a
dynamic embedding; here the same pair gives the :class:`~tensorkv.StorageOption` of a table
whose rows live in Redis, or the table itself. The config file is found as TFRA finds it
(``redis_config_abs_dir_env`` > ``TFRA_REDIS_CONFIG_PATH`` > ``redis_config_abs_dir``; see
:mod:`tensorkv.stores.tfra_config`) and read with TFRA's keys and units.

Examples
--------
>>> from tensorkv.compat.tfra import RedisTableConfig, RedisTableCreator
>>> creator = RedisTableCreator(RedisTableConfig(redis_config_abs_dir="/etc/redis.json"))
>>> table = creator.create(dim=16, name="user_embeddings")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tensorkv.embedding import EmbeddingTable, StorageOption
from tensorkv.errors import ConfigError


@dataclass(frozen=True)
class RedisTableConfig:
    """Where TFRA's JSON config file is: TFRA's two arguments, same names, same order.

    Attributes
    ----------
    redis_config_abs_dir
        Path of the JSON file, read when neither environment variable names one.
    redis_config_abs_dir_env
        Name of an environment variable holding the path (None: ``TFRA_REDIS_CONFIG_PATH``,
        after ``TENSORKV_REDIS_CONFIG_PATH``).
    """

    redis_config_abs_dir: str | os.PathLike[str] | None = None
    redis_config_abs_dir_env: str | None = None


class RedisTableCreator:
    """Make Redis-resident tables from a :class:`RedisTableConfig` (TFRA's ``kv_creator``).

    Parameters
    ----------
    config
        Where the config file is (None: found through the environment variables only).
    **options
        Further table or store options (tensorkv's or TFRA's names), overriding the file's,
        e.g. ``consistency="last_writer_wins"``.
    """

    def __init__(self, config: RedisTableConfig | None = None, **options: Any) -> None:
        if config is not None and not isinstance(config, RedisTableConfig):
            raise ConfigError(f"config={config!r} must be a RedisTableConfig, e.g. "
                              "RedisTableConfig(redis_config_abs_dir='/etc/redis.json')")
        self.config = config or RedisTableConfig()
        self.options = dict(options)

    def storage_option(self, name: str | None = None) -> StorageOption:
        """The storage of one table; ``name`` is TFRA's embedding name (``table_name``)."""
        opts = dict(self.options)
        if self.config.redis_config_abs_dir is not None:
            opts["redis_config_abs_dir"] = os.fspath(self.config.redis_config_abs_dir)
        if self.config.redis_config_abs_dir_env is not None:
            opts["redis_config_abs_dir_env"] = self.config.redis_config_abs_dir_env
        if name is not None:
            opts["table_name"] = name
        return StorageOption("REDIS", redis_options=opts)

    def create(self, dim: int, name: str | None = None, **table_kwargs: Any) -> EmbeddingTable:
        """An :class:`~tensorkv.EmbeddingTable` of ``dim`` whose rows live in Redis.

        ``table_kwargs`` are the table's (``optimizer``, ``initializer``, ``seed``...).
        """
        return EmbeddingTable(dim, storage=self.storage_option(name), **table_kwargs)


__all__ = ["RedisTableConfig", "RedisTableCreator"]
