"""Options of the Redis backend: one dataclass, its validation, and the JSON config file.

Options come from four places; later ones win:

1. a JSON config file (an object whose keys are option names), found in this order:
   the environment variable *named* by ``config_env`` (if given and set), then
   ``TENSORKV_REDIS_CONFIG_PATH``, then the explicit ``config=`` path;
2. credentials in the URL (``redis://user:pass@host``);
3. the URL query string;
4. keyword arguments of :func:`tensorkv.open_store`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from tensorkv import config
from tensorkv.errors import ConfigError
from tensorkv.stores.tfra_config import translate

_CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True)
class RedisOptions:
    """Validated options of a :class:`~tensorkv.stores.redis.RedisStore`.

    Attributes
    ----------
    prefix
        Namespace prepended to every key and stripped from scanned keys (bytes; a str is
        UTF-8 encoded). Default ``b""`` (no namespace).
    keys_sending_size
        Keys per Redis command in pipelined MGET/MSET/UNLINK and the SCAN ``COUNT`` hint.
    max_connections
        Connections per server in the pool (None: unbounded). When bounded, a thread that
        finds every connection busy waits up to ``socket_timeout`` seconds for one.
    connect_timeout
        Seconds to wait for a TCP/TLS connection to a server.
    socket_timeout
        Seconds to wait for a reply once connected.
    retries
        Retries after the first attempt on connection errors and timeouts.
    retry_backoff
        Seconds before the first retry; doubled before each later one.
    read_from_replicas
        Cluster: read from replicas (round robin). Sentinel: read through a replica
        connection (``slave_for``). Replica reads may lag the latest writes.
    ssl_ca_certs, ssl_certfile, ssl_keyfile
        PEM files: CA bundle that signs the server certificate, client certificate and key.
    ssl_cert_reqs
        Server certificate check: ``"required"`` (default), ``"optional"`` or ``"none"``.
    ssl_check_hostname
        Check that the server certificate names the host connected to.
    username, password
        Redis ACL user and password (override those in the URL).
    readonly
        Refuse every write.
    wait_replicas
        ``flush()`` (called by checkpoints before a tag becomes visible) waits until this
        many replicas acknowledged every write (Redis ``WAIT``); 0 (default) does not wait.
    wait_timeout
        Seconds ``flush()`` waits for ``wait_replicas`` acknowledgements before it raises
        :class:`~tensorkv.errors.ReplicationError`.
    socket_keepalive
        Turn on TCP keep-alive on every connection (TFRA's ``redis_connect_keep_alive``).
    pool_timeout
        With ``max_connections``: seconds a thread waits for a free connection (None: the
        ``socket_timeout``); TFRA's ``redis_wait_timeout``.
    sentinel_username, sentinel_password
        Credentials of the Sentinels themselves (``username``/``password`` are the data
        servers'); TFRA's ``redis_sentinel_user``/``redis_sentinel_password``.
    sentinel_connect_timeout, sentinel_socket_timeout
        Seconds to connect to, and wait for a reply from, a Sentinel (None: the
        ``connect_timeout``/``socket_timeout``).
    """

    prefix: bytes = b""
    keys_sending_size: int = config.REDIS_KEYS_SENDING_SIZE
    max_connections: int | None = None
    connect_timeout: float = config.REDIS_CONNECT_TIMEOUT
    socket_timeout: float = config.REDIS_SOCKET_TIMEOUT
    retries: int = config.REDIS_RETRIES
    retry_backoff: float = config.REDIS_RETRY_BACKOFF
    read_from_replicas: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True
    username: str | None = None
    password: str | None = None
    readonly: bool = False
    wait_replicas: int = 0
    wait_timeout: float = config.REDIS_WAIT_TIMEOUT
    socket_keepalive: bool = False
    pool_timeout: float | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    sentinel_connect_timeout: float | None = None
    sentinel_socket_timeout: float | None = None

    def sentinel_kwargs(self, conn: dict[str, Any]) -> dict[str, Any]:
        """Connection keywords for the Sentinels, from the data servers' ``conn``."""
        kw = {k: v for k, v in conn.items() if k not in ("username", "password")}
        if self.sentinel_password is not None:
            kw.update(username=self.sentinel_username, password=self.sentinel_password)
        if self.sentinel_connect_timeout is not None:
            kw["socket_connect_timeout"] = self.sentinel_connect_timeout
        if self.sentinel_socket_timeout is not None:
            kw["socket_timeout"] = self.sentinel_socket_timeout
        return kw


#: Options naming where the JSON config file is; accepted by ``from_url`` but not in a file.
CONFIG_OPTIONS = ("config", "config_env")
OPTION_NAMES = tuple(f.name for f in fields(RedisOptions))
VALID_OPTIONS = tuple(sorted(OPTION_NAMES + CONFIG_OPTIONS))

#: Keys a config file may hold for a Redis-resident table (docs/redis_table.md); the store
#: ignores them, so one file can configure both.
TABLE_FILE_KEYS = frozenset({
    "url", "table_name", "model_tag_runtime", "model_tag_import", "storage_slice",
    "storage_slice_import", "using_hash_storage_slice", "redis_hash_tags_runtime",
    "redis_hash_tags_import", "expire_model_tag_in_seconds", "table_store_mode",
    "model_lib_abs_dir", "redis_read_access_slave", "consistency", "read_only",
    "read_cache_rows", "read_cache_seconds", "near_cache_rows", "near_cache_bytes",
    "near_cache_min_freq", "lock_ttl_seconds", "lock_wait_seconds",
    "on_lost", "must_exist",
})

_STR_OPTIONS = {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "username",
                "password", "config", "config_env", "sentinel_username", "sentinel_password"}
_BOOL_OPTIONS = {"read_from_replicas", "ssl_check_hostname", "readonly", "socket_keepalive"}
_FLOAT_OPTIONS = {"connect_timeout", "socket_timeout", "retry_backoff", "wait_timeout",
                  "pool_timeout", "sentinel_connect_timeout", "sentinel_socket_timeout"}
_NULLABLE = {"max_connections", "pool_timeout", "sentinel_connect_timeout",
             "sentinel_socket_timeout"}
_INT_OPTIONS = {"keys_sending_size", "max_connections", "retries", "wait_replicas"}


def check_names(names: Any, where: str, *, allow_config: bool = True) -> None:
    """Raise :class:`ConfigError` naming every unknown option in ``names``."""
    valid = VALID_OPTIONS if allow_config else OPTION_NAMES
    unknown = sorted(set(names) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown Redis option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"in {where}; valid options are: {', '.join(sorted(valid))}"
        )


def _to_bool(name: str, value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(
        f"Redis option {name}={value!r} ({where}) is not a boolean; use true or false"
    )


def _to_number(name: str, value: Any, where: str, kind: type) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"Redis option {name}={value!r} ({where}) must be a number")
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value)
        except ValueError:
            raise ConfigError(
                f"Redis option {name}={value!r} ({where}) is not "
                f"{'a number' if kind is float else 'an integer'}"
            ) from None
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ConfigError(
            f"Redis option {name}={value!r} ({where}) must be "
            f"{'a number' if kind is float else 'an integer'}"
        )
    return kind(value)


def convert_option(name: str, value: Any, where: str) -> Any:
    """Convert and range-check one option value; raise :class:`ConfigError` when invalid."""
    if name == "prefix":
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value).encode()
        raise ConfigError(f"Redis option prefix={value!r} ({where}) must be a str or bytes")
    if value is None:
        if name in _STR_OPTIONS - {"ssl_cert_reqs"} or name in _NULLABLE:
            return None
        raise ConfigError(f"Redis option {name} ({where}) may not be null")
    if name in _STR_OPTIONS:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"Redis option {name}={value!r} ({where}) must be a string")
        if name == "ssl_cert_reqs":
            low = value.strip().lower()
            if low not in _CERT_REQS:
                raise ConfigError(
                    f"Redis option ssl_cert_reqs={value!r} ({where}) must be one of "
                    f"{', '.join(_CERT_REQS)}"
                )
            return low
        if name in {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"} and not os.path.isfile(value):
            raise ConfigError(
                f"Redis option {name}={value!r} ({where}): no such file; give the path of a "
                "PEM file"
            )
        return value
    if name in _BOOL_OPTIONS:
        return _to_bool(name, value, where)
    if name in _FLOAT_OPTIONS:
        v = _to_number(name, value, where, float)
        if not v > 0 and name != "retry_backoff":
            raise ConfigError(f"Redis option {name}={v} ({where}) must be > 0 seconds")
        if v < 0:
            raise ConfigError(f"Redis option {name}={v} ({where}) must be >= 0 seconds")
        return v
    if name in _INT_OPTIONS:
        v = _to_number(name, value, where, int)
        minimum = 0 if name in ("retries", "wait_replicas") else 1
        if v < minimum:
            raise ConfigError(f"Redis option {name}={v} ({where}) must be >= {minimum}")
        return v
    check_names([name], where)  # raises
    raise AssertionError(name)  # pragma: no cover


def find_config_file(config_path: str | None, config_env: str | None) -> tuple[str, str] | None:
    """Locate the JSON config file; return ``(path, where it came from)`` or None.

    Priority: the environment variable named by ``config_env``, then
    ``TENSORKV_REDIS_CONFIG_PATH``, then ``config_path``.
    """
    if config_env is not None:
        if not isinstance(config_env, str) or not config_env:
            raise ConfigError(
                f"config_env={config_env!r} must name an environment variable, e.g. "
                "config_env='MY_REDIS_CONFIG'"
            )
        raw = os.environ.get(config_env, "").strip()
        if raw:
            return raw, f"environment variable {config_env}"
    raw = os.environ.get(config.ENV_REDIS_CONFIG_PATH, "").strip()
    if raw:
        return raw, f"environment variable {config.ENV_REDIS_CONFIG_PATH}"
    if config_path:
        return str(config_path), "option config"
    return None


def read_json_object(path: str, source: str, what: str = "Redis config file") -> dict[str, Any]:
    """The JSON object in ``path`` (named ``what``, found through ``source``), or a clear error."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(
            f"{what} {path!r} (from {source}) does not exist; fix the path or unset it"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what} {path!r} (from {source}) is unreadable: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{what} {path!r} must hold a JSON object of options, not {type(data).__name__}"
        )
    return data


def load_config_file(path: str, source: str) -> dict[str, Any]:
    """Read a JSON config file into a dict of converted options."""
    data = read_json_object(path, source)
    where = f"config file {path}"
    # TFRA's keys: its connection options become ours; the servers come from the store's URL
    data = translate(data, servers=False, where=where)
    data = {k: v for k, v in data.items() if k not in TABLE_FILE_KEYS}
    check_names(data, where, allow_config=False)
    return {k: convert_option(k, v, where) for k, v in data.items()}


def resolve_options(
    options: dict[str, Any],
    *,
    url_username: str | None = None,
    url_password: str | None = None,
    where: str = "options",
) -> tuple[RedisOptions, str | None]:
    """Merge the config file, URL credentials and explicit options into :class:`RedisOptions`.

    Parameters
    ----------
    options
        Query-string options updated with keyword arguments (``config``/``config_env``
        included).
    url_username, url_password
        Credentials from the URL's netloc.
    where
        Where ``options`` came from, for error messages.

    Returns
    -------
    (RedisOptions, str or None)
        The options and the path of the config file used, if any.
    """
    check_names(options, where)
    opts = dict(options)
    config_path = opts.pop("config", None)
    config_env = opts.pop("config_env", None)
    found = find_config_file(config_path, config_env)
    merged: dict[str, Any] = {}
    if found is not None:
        merged.update(load_config_file(*found))
    if url_username is not None:
        merged["username"] = url_username
    if url_password is not None:
        merged["password"] = url_password
    merged.update({k: convert_option(k, v, where) for k, v in opts.items()})
    return RedisOptions(**merged), (found[0] if found else None)
