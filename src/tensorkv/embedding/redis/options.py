"""Options of a Redis-resident table (TFRA's names) and their JSON config file.

:class:`RedisTableOptions` holds every setting of a table whose rows live in Redis;
:func:`resolve_table_options` merges a JSON config file (found by the priority below) with
explicit options; TFRA's keys and units are translated by :mod:`tensorkv.stores.tfra_config`.
Config file priority: the environment variable named by ``config_env`` (TFRA:
``redis_config_abs_dir_env``) > ``TENSORKV_REDIS_CONFIG_PATH`` > ``TFRA_REDIS_CONFIG_PATH`` >
the path given (``storage_path`` ending in ``.json``, ``config=`` or TFRA's
``redis_config_abs_dir``). See docs/redis_table.md ("Options").
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from tensorkv import config
from tensorkv.errors import ConfigError
from tensorkv.stores import tfra_config
from tensorkv.stores.redis_config import OPTION_NAMES as STORE_OPTION_NAMES

CONSISTENCY_MODES = ("exact", "last_writer_wins")
ON_LOST = ("raise", "start_empty")
_TAG_CHARS = frozenset("{}")


@dataclass(frozen=True)
class RedisTableOptions:
    """Settings of a table whose rows live in Redis (defaults in :mod:`tensorkv.config`).

    Attributes
    ----------
    url
        ``redis://``, ``rediss://``, ``redis+cluster://`` or ``redis+sentinel://`` URL.
    table_name, model_tag_runtime
        The table's rows are the Redis hashes ``<model_tag_runtime>:<table_name>{<tag>}``;
        a second process opening the same options opens the same rows.
    model_tag_import
        The tag a new model starts from: on first open its rows are copied to the runtime
        tag (resumable), then the model reads and writes only under its own tag.
    storage_slice, storage_slice_import
        Buckets (Redis hashes) the rows are spread over, now and in the imported rows; a
        different import count rehashes the rows on first open.
    using_hash_storage_slice
        A key's bucket by a 64-bit hash of the key (even spread) instead of ``key mod
        storage_slice`` (TFRA's default, uneven when keys share residues).
    keys_sending_size
        Keys per Redis command; the commands of a batch are pipelined per node.
    redis_hash_tags_runtime, redis_hash_tags_import
        One hash tag per bucket (so a bucket stays on one Cluster node); None: generated
        so the buckets spread evenly over the 16384 Cluster slots.
    expire_model_tag_in_seconds
        After copying ``model_tag_import``'s rows to a new tag, expire the old tag's
        buckets after this many seconds (0: keep them).
    table_store_mode
        What ``export()`` (hence ``tensorkv.save``) carries: 0 every row (the checkpoint
        holds them), 1 none (rows are dumped to files under ``model_lib_abs_dir`` and
        restored from them into an empty tag on open), 2 none (rows live in Redis only).
    model_lib_abs_dir
        Directory of the mode-1 dump files.
    redis_read_access_slave
        Read through replicas (serving); writes still go to the primaries.
    consistency
        ``"exact"``: every operation that writes holds its buckets' locks from read to write
        (fenced commit), so concurrent trainers lose no update; ``"last_writer_wins"``: no
        locks, a row written by two processes at once keeps the last write (TFRA).
    read_only
        Never write (serving): lookups return stored rows, and the initial value for keys
        without one, with no insertion and no frequency count.
    read_cache_rows, read_cache_seconds
        With ``read_only``: rows kept in a DRAM cache (0: none) and the seconds after which
        the cache is dropped (rows may be that stale).
    near_cache_rows, near_cache_bytes, near_cache_min_freq
        A coherent near-cache of hot rows in this process (0, 0: none): at most this many
        rows and bytes (the smaller bound wins; 0 leaves a bound out), admitting rows whose
        stored frequency is at least ``near_cache_min_freq``. Every cached row is checked
        against its bucket's version in the round trip of the read, so it is never stale
        (:mod:`tensorkv.embedding.chain.near_cache`).
    lock_ttl_seconds, lock_wait_seconds
        Exact mode: a bucket lock expires after ``lock_ttl_seconds`` (a crashed holder
        frees it); a writer waits at most ``lock_wait_seconds`` for a lock.
    on_lost
        What opening a table whose rows were lost does (a restart without persistence, a
        flush, an eviction, a failover to a replica that lacks them): ``"raise"``
        (:class:`~tensorkv.errors.TableLostError`) or ``"start_empty"``: empty what is left
        under a new epoch (every other process must reopen), e.g. before loading a
        checkpoint into it. Also abandons an unfinished copy from another model tag.
    must_exist
        Refuse to open a tag that holds no table at all instead of creating it (a server
        that lost everything leaves no trace: resuming trainers can say so). Read-only
        tables always refuse.
    store_options
        Connection options of the Redis store (``password``, ``ssl_ca_certs``, ...).
    """

    url: str
    table_name: str = config.REDIS_TABLE_NAME
    model_tag_runtime: str = config.REDIS_TABLE_MODEL_TAG
    model_tag_import: str | None = None
    storage_slice: int = config.REDIS_TABLE_STORAGE_SLICE
    storage_slice_import: int | None = None
    using_hash_storage_slice: bool = False
    keys_sending_size: int = config.REDIS_KEYS_SENDING_SIZE
    redis_hash_tags_runtime: tuple[str, ...] | None = None
    redis_hash_tags_import: tuple[str, ...] | None = None
    expire_model_tag_in_seconds: int = 0
    table_store_mode: int = 0
    model_lib_abs_dir: str | None = None
    redis_read_access_slave: bool = False
    consistency: str = "exact"
    read_only: bool = False
    read_cache_rows: int = 0
    read_cache_seconds: float = config.REDIS_TABLE_READ_CACHE_SECONDS
    near_cache_rows: int = 0
    near_cache_bytes: int = 0
    near_cache_min_freq: int = 0
    lock_ttl_seconds: float = config.REDIS_TABLE_LOCK_TTL
    lock_wait_seconds: float = config.REDIS_TABLE_LOCK_WAIT
    on_lost: str = "raise"
    must_exist: bool = False
    store_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis", "rediss")):
            raise ConfigError(f"url={self.url!r} must be a Redis URL such as "
                              "'redis://localhost:6379/0' or 'redis+cluster://h1:7000,h2:7001'")
        for name in ("table_name", "model_tag_runtime"):
            _check_name(name, getattr(self, name))
        if self.model_tag_import is None:
            object.__setattr__(self, "model_tag_import", self.model_tag_runtime)
        _check_name("model_tag_import", self.model_tag_import)
        for name, lo in (("storage_slice", 1), ("keys_sending_size", 1),
                         ("expire_model_tag_in_seconds", 0), ("read_cache_rows", 0),
                         ("near_cache_rows", 0), ("near_cache_bytes", 0),
                         ("near_cache_min_freq", 0)):
            _check_int(name, getattr(self, name), lo)
        if self.storage_slice_import is None:
            object.__setattr__(self, "storage_slice_import", self.storage_slice)
        _check_int("storage_slice_import", self.storage_slice_import, 1)
        for name in ("redis_hash_tags_runtime", "redis_hash_tags_import"):
            tags = getattr(self, name)
            n = self.storage_slice if name.endswith("runtime") else self.storage_slice_import
            object.__setattr__(self, name, _check_tags(name, tags, int(n or 0)))
        if self.table_store_mode not in (0, 1, 2) or isinstance(self.table_store_mode, bool):
            raise ConfigError(f"table_store_mode={self.table_store_mode!r} must be 0 (rows in "
                              "the checkpoint), 1 (dump files) or 2 (Redis only)")
        if self.table_store_mode == 1:
            d = self.model_lib_abs_dir
            if not isinstance(d, str) or not os.path.isabs(d):
                raise ConfigError(f"table_store_mode=1 dumps rows to files and needs "
                                  f"model_lib_abs_dir, an absolute directory; got {d!r}")
        if self.consistency not in CONSISTENCY_MODES:
            raise ConfigError(f"consistency={self.consistency!r} must be one of "
                              f"{', '.join(CONSISTENCY_MODES)}")
        if self.on_lost not in ON_LOST:
            raise ConfigError(f"on_lost={self.on_lost!r} must be one of {', '.join(ON_LOST)}")
        for name in ("using_hash_storage_slice", "redis_read_access_slave", "read_only",
                     "must_exist"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        for name in ("read_cache_seconds", "lock_ttl_seconds", "lock_wait_seconds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                    or not math.isfinite(v):
                raise ConfigError(f"{name}={v!r} must be a finite number of seconds > 0, "
                                  "e.g. 30")
        if self.lock_ttl_seconds < 0.001:  # Redis expires keys in whole milliseconds
            raise ConfigError(f"lock_ttl_seconds={self.lock_ttl_seconds!r} is under the "
                              "1 ms that Redis can expire a lock after; give at least 0.001")
        if self.read_cache_rows and not self.read_only:
            raise ConfigError("read_cache_rows needs read_only=True: a cache of rows that "
                              "this process also writes would serve stale rows")
        if self.redis_read_access_slave and (self.near_cache_rows or self.near_cache_bytes):
            raise ConfigError(
                f"near_cache_rows={self.near_cache_rows} / near_cache_bytes="
                f"{self.near_cache_bytes} with redis_read_access_slave=True: the near-cache "
                "checks each bucket's version on the connection that reads its rows, and reads "
                "spread over replicas (each behind the primary by its own lag) can answer the "
                "version and the rows from two of them. Read the primaries "
                "(redis_read_access_slave=False) or use read_cache_rows")
        if self.read_cache_rows and (self.near_cache_rows or self.near_cache_bytes):
            raise ConfigError(
                f"read_cache_rows={self.read_cache_rows} and near_cache_rows="
                f"{self.near_cache_rows} / near_cache_bytes={self.near_cache_bytes} are two "
                "caches of the same rows: give one (the near-cache is never stale, the read "
                "cache needs no round trip but may be read_cache_seconds stale)")

    @property
    def migrates(self) -> bool:
        """Whether the imported rows differ in place from the runtime rows (first open copies)."""
        return (self.model_tag_import != self.model_tag_runtime
                or self.storage_slice_import != self.storage_slice
                or self.redis_hash_tags_import != self.redis_hash_tags_runtime)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (passwords left out)."""
        d = asdict(self)
        d["store_options"] = {k: v for k, v in self.store_options if k != "password"}
        for name in ("redis_hash_tags_runtime", "redis_hash_tags_import"):
            if d[name] is not None:
                d[name] = list(d[name])
        return d


TABLE_OPTION_NAMES = tuple(f.name for f in fields(RedisTableOptions) if f.name != "store_options")
_CONFIG_KEYS = ("config", "config_env", "redis_config_abs_dir", "redis_config_abs_dir_env")


def _check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or _TAG_CHARS & set(value) or ":" in value:
        raise ConfigError(f"{name}={value!r} must be a non-empty string without ':', '{{' or "
                          "'}'; e.g. 'v1'")


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo}")


def _check_tags(name: str, tags: Any, n: int) -> tuple[str, ...] | None:
    if tags is None:
        return None
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
        raise ConfigError(f"{name}={tags!r} must be a list of {n} hash tags (one per bucket)")
    tags = tuple(tags)
    if len(tags) != n or len(set(tags)) != n:
        raise ConfigError(f"{name} has {len(tags)} tags ({len(set(tags))} distinct); give {n} "
                          "distinct tags, one per bucket, or none to generate them")
    for t in tags:
        if not isinstance(t, str) or not t or _TAG_CHARS & set(t):
            raise ConfigError(f"hash tag {t!r} in {name} must be a non-empty string without "
                              "'{' or '}'")
    return tags


def _one_of(opts: dict[str, Any], ours: str, theirs: str) -> Any:
    """Pop tensorkv's option ``ours`` or TFRA's twin ``theirs`` (refuse both)."""
    if ours in opts and theirs in opts:
        raise ConfigError(f"{ours} and {theirs} (TFRA's name) are both given; keep one")
    a, b = opts.pop(ours, None), opts.pop(theirs, None)
    return a if a is not None else b


def resolve_table_options(storage_path: str | os.PathLike[str] | None,
                          options: dict[str, Any] | None) -> RedisTableOptions:
    """Build :class:`RedisTableOptions` from ``storage_path`` and explicit ``options``.

    ``storage_path`` is the Redis URL or the path of a JSON config file (an object of option
    names, its ``"url"`` included, plus Redis store options, or TFRA's config file). The file
    actually read is, by priority: the one named by the environment variable
    ``options["config_env"]`` (or ``redis_config_abs_dir_env``), then
    ``TENSORKV_REDIS_CONFIG_PATH``, then ``TFRA_REDIS_CONFIG_PATH``, then ``options["config"]``
    (or ``redis_config_abs_dir``) or a ``.json`` ``storage_path``. Explicit options override
    the file's; an explicit URL overrides the servers a file names.
    """
    opts = dict(options or {})
    given = _one_of(opts, "config", "redis_config_abs_dir")
    env = _one_of(opts, "config_env", "redis_config_abs_dir_env")
    url = None
    if storage_path is not None:
        if not isinstance(storage_path, (str, os.PathLike)):
            raise ConfigError(f"storage_path={storage_path!r} must be a Redis URL or the path "
                              "of a JSON config file")
        sp = os.fspath(storage_path)
        if "://" in sp:
            url = sp
        elif given is None:
            given = sp
    found = tfra_config.find_table_config(given, env)
    merged: dict[str, Any] = {}
    if found is not None:
        data = tfra_config.read_config(*found)
        # a file without "url" is TFRA's: the keys it omits take TFRA's defaults
        merged.update(tfra_config.translate(
            data, tfra_defaults="url" not in data, where=f"config file {found[0]}",
            servers=url is None and "url" not in opts))
    merged.update(tfra_config.translate(opts, where="redis_options", servers=url is None))
    if url is not None:
        merged["url"] = url
    if "url" not in merged:
        raise ConfigError("a Redis-resident table needs its URL: storage_path="
                          "'redis://host:6379/0', a JSON config file with \"url\", or TFRA's "
                          "config file (redis_host_ip, redis_host_port...; found through "
                          "TFRA_REDIS_CONFIG_PATH or redis_config_abs_dir)")
    store = {k: merged.pop(k) for k in list(merged)
             if k in STORE_OPTION_NAMES and k not in TABLE_OPTION_NAMES}
    unknown = sorted(set(merged) - set(TABLE_OPTION_NAMES))
    if unknown:
        raise ConfigError(
            f"unknown Redis table option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"table options: {', '.join(TABLE_OPTION_NAMES)}; store options: "
            f"{', '.join(STORE_OPTION_NAMES)}; TFRA's keys: {', '.join(tfra_config.TFRA_KEYS)}")
    for name in ("redis_hash_tags_runtime", "redis_hash_tags_import"):
        if isinstance(merged.get(name), list):
            merged[name] = tuple(merged[name])
    if merged.get("redis_read_access_slave"):
        store["read_from_replicas"] = True
    return RedisTableOptions(**merged, store_options=tuple(sorted(store.items())))


__all__ = ["CONSISTENCY_MODES", "ON_LOST", "TABLE_OPTION_NAMES", "RedisTableOptions",
           "resolve_table_options"]
