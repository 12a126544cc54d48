"""TFRA's Redis JSON config, read as TFRA 0.8.1 documents it, and translated to tensorkv's options.

A TFRA job describes its Redis table with a JSON file of 31 keys (``redis_connection_mode``,
``redis_host_ip``, ``redis_socket_timeout`` in milliseconds, ...). :func:`translate` turns
such keys, given in a file or as options, into tensorkv's own option names: a Redis URL
(``url``), the Redis store's connection options and the Redis-resident table's options.
:func:`find_table_config` finds the file by TFRA's lookup order, with tensorkv's own names
beside it. Keys that have no effect here are accepted (docs/coming_from.md lists them) and a
warning names the ones given a value that would change what TFRA does.

Lookup order of the file (first found wins):

1. the environment variable named by ``config_env`` or ``redis_config_abs_dir_env``;
2. ``TENSORKV_REDIS_CONFIG_PATH``, then ``TFRA_REDIS_CONFIG_PATH`` (TFRA's default name);
   when both are set to different files, the ``TENSORKV_*`` one wins with a warning;
3. the path given: ``config``, ``redis_config_abs_dir`` or a ``.json`` ``storage_path``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

from tensorkv import config
from tensorkv.errors import ConfigError

#: TFRA's default environment variable naming the config file.
ENV_TFRA_REDIS_CONFIG_PATH = "TFRA_REDIS_CONFIG_PATH"

#: TFRA's connection modes (``redis_connection_mode``).
CLUSTER, SENTINEL, STANDALONE = 0, 1, 2
_MODE_NAMES = {CLUSTER: "0 (cluster)", SENTINEL: "1 (sentinel)", STANDALONE: "2 (standalone)"}

#: Every key TFRA 0.8.1 reads from its config file, with TFRA's default and JSON type.
TFRA_KEYS: dict[str, tuple[Any, str]] = {
    "redis_connection_mode": (SENTINEL, "int"),
    "redis_master_name": ("master", "str"),
    "redis_host_ip": (["127.0.0.1"], "str_list"),
    "redis_host_port": ([6379], "int_list"),
    "redis_user": ("default", "str"),
    "redis_password": ("", "str"),
    "redis_db": (0, "int"),
    "redis_read_access_slave": (False, "bool"),
    "redis_connect_keep_alive": (False, "bool"),
    "redis_connect_timeout": (1000, "int"),  # milliseconds
    "redis_socket_timeout": (1000, "int"),  # milliseconds
    "redis_conn_pool_size": (20, "int"),
    "redis_wait_timeout": (100000000, "int"),  # milliseconds
    "redis_connection_lifetime": (100, "int"),  # minutes
    "redis_sentinel_user": ("default", "str"),
    "redis_sentinel_password": ("", "str"),
    "redis_sentinel_connect_timeout": (1000, "int"),  # milliseconds
    "redis_sentinel_socket_timeout": (1000, "int"),  # milliseconds
    "storage_slice_import": (-1, "int"),
    "storage_slice": (1, "int"),
    "using_hash_storage_slice": (False, "bool"),
    "keys_sending_size": (1024, "int"),
    "using_md5_prefix_name": (False, "bool"),
    "redis_hash_tags_hypodispersion": (False, "bool"),
    "model_tag_import": ("test", "str"),
    "redis_hash_tags_import": ([], "str_list"),
    "model_tag_runtime": ("test", "str"),
    "redis_hash_tags_runtime": ([], "str_list"),
    "expire_model_tag_in_seconds": (604800, "int"),
    "table_store_mode": (1, "int"),
    "model_lib_abs_dir": ("/tmp/", "str"),
}

#: Keys that choose the server(s): together they make the table's Redis URL.
URL_KEYS = ("redis_connection_mode", "redis_master_name", "redis_host_ip", "redis_host_port",
            "redis_db")

#: TFRA key -> (tensorkv store option, factor from TFRA's unit to tensorkv's).
_STORE_KEYS: dict[str, tuple[str, float | None]] = {
    "redis_connect_keep_alive": ("socket_keepalive", None),
    "redis_connect_timeout": ("connect_timeout", 1e-3),
    "redis_socket_timeout": ("socket_timeout", 1e-3),
    "redis_conn_pool_size": ("max_connections", None),
    "redis_wait_timeout": ("pool_timeout", 1e-3),
    "redis_sentinel_connect_timeout": ("sentinel_connect_timeout", 1e-3),
    "redis_sentinel_socket_timeout": ("sentinel_socket_timeout", 1e-3),
}

#: Table keys TFRA shares with tensorkv (same name, same meaning once translated).
_TABLE_KEYS = ("storage_slice", "storage_slice_import", "using_hash_storage_slice",
               "keys_sending_size", "model_tag_import", "model_tag_runtime",
               "redis_hash_tags_import", "redis_hash_tags_runtime",
               "expire_model_tag_in_seconds", "table_store_mode", "model_lib_abs_dir",
               "redis_read_access_slave")

#: Keys accepted with no effect here, with the value under which TFRA behaves as tensorkv
#: does (a different value warns) and why.
NO_EFFECT: dict[str, tuple[Any, str]] = {
    "redis_connection_lifetime": (
        None, "redis-py keeps a pooled connection until it fails; it does not recycle "
              "connections by age"),
    "using_md5_prefix_name": (
        False, "it names keys in TFRA's own byte layout; the table's rows keep tensorkv's "
               "key names"),
    "redis_hash_tags_hypodispersion": (
        None, "generated hash tags always spread the buckets evenly over the 16384 Cluster "
              "slots"),
}

#: tensorkv's own spelling of each TFRA key, for conflicts (both given at once).
_TWINS = {**{k: v for k, (v, _) in _STORE_KEYS.items()},
          "redis_user": "username", "redis_password": "password",
          "redis_sentinel_user": "sentinel_username",
          "redis_sentinel_password": "sentinel_password"}


def _type_error(key: str, value: Any, kind: str, where: str) -> ConfigError:
    want = {"int": "an integer", "bool": "true or false", "str": "a string",
            "str_list": "a list of strings", "int_list": "a list of integers"}[kind]
    return ConfigError(f"TFRA option {key}={value!r} ({where}) must be {want}")


def _check(key: str, value: Any, where: str) -> Any:
    """TFRA's JSON type of ``key`` (a lone host or port is taken as a list of one)."""
    kind = TFRA_KEYS[key][1]
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, value, kind, where)
        return value
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # TFRA's docs: "1=true, 0=false"
            return bool(value)
        raise _type_error(key, value, kind, where)
    if kind == "str":
        if not isinstance(value, str):
            raise _type_error(key, value, kind, where)
        return value
    item = str if kind == "str_list" else int
    if isinstance(value, item) and not isinstance(value, bool) and key.startswith("redis_host"):
        value = [value]
    if not isinstance(value, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, item) for v in value):
        raise _type_error(key, value, kind, where)
    return list(value)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tags(tags: list[Any] | tuple[Any, ...]) -> tuple[Any, ...] | None:
    """TFRA's hash tags: an empty list means "generate"; ``{6379}`` is the tag ``6379``."""
    if not tags:
        return None
    return tuple(t[1:-1] if isinstance(t, str) and len(t) >= 2 and t[0] == "{"
                 and t[-1] == "}" else t for t in tags)


def _url(raw: dict[str, Any], where: str) -> str:
    mode = raw.get("redis_connection_mode", SENTINEL)
    if mode not in _MODE_NAMES:
        raise ConfigError(f"TFRA option redis_connection_mode={mode!r} ({where}) must be one "
                          f"of {', '.join(_MODE_NAMES.values())}")
    ips = raw.get("redis_host_ip", TFRA_KEYS["redis_host_ip"][0])
    ports = raw.get("redis_host_port", TFRA_KEYS["redis_host_port"][0])
    if not ips or len(ips) != len(ports):
        raise ConfigError(f"TFRA options redis_host_ip={ips!r} and redis_host_port={ports!r} "
                          f"({where}) must list one port per host, at least one host")
    for p in ports:
        if not 0 < p < 65536:
            raise ConfigError(f"TFRA option redis_host_port has port {p} ({where}); give "
                              "ports between 1 and 65535")
    db = raw.get("redis_db", 0)
    if db < 0:
        raise ConfigError(f"TFRA option redis_db={db} ({where}) must be >= 0")
    hosts = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in zip(ips, ports, strict=True)]
    if "redis_connection_mode" not in raw:
        mode = _probe_mode(ips[0], ports[0])
    if mode == CLUSTER:
        if db:
            warnings.warn(f"TFRA option redis_db={db} ({where}) has no effect on a Redis "
                          "Cluster, which has only database 0", UserWarning, stacklevel=4)
        return "redis+cluster://" + ",".join(hosts)
    if mode == SENTINEL:
        master = raw.get("redis_master_name", TFRA_KEYS["redis_master_name"][0])
        if not master or "/" in master:
            raise ConfigError(f"TFRA option redis_master_name={master!r} ({where}) must name "
                              "the Sentinel service, e.g. 'mymaster'")
        return f"redis+sentinel://{','.join(hosts)}/{master}/{db}"
    if len(hosts) > 1:
        warnings.warn(f"TFRA standalone mode ({where}) connects to the first host "
                      f"{hosts[0]} only, as TFRA does; {', '.join(hosts[1:])} are not used",
                      UserWarning, stacklevel=4)
    return f"redis://{hosts[0]}/{db}"


def _probe_mode(host: str, port: int) -> int:
    """TFRA's default mode (Sentinel, else the server itself): ask the first host what it is."""
    try:
        import redis
    except ImportError:  # pragma: no cover - the redis extra is installed with any Redis use
        return STANDALONE
    client = redis.Redis(host=host, port=port, socket_connect_timeout=config.REDIS_CONNECT_TIMEOUT,
                         socket_timeout=config.REDIS_CONNECT_TIMEOUT)
    try:
        mode = client.info("server").get("redis_mode", "standalone")
    except Exception:  # noqa: BLE001 - unreachable or refused: opening the store reports it
        return STANDALONE
    finally:
        client.close()
    return SENTINEL if mode == "sentinel" else CLUSTER if mode == "cluster" else STANDALONE


def translate(options: dict[str, Any], *, tfra_defaults: bool = False, servers: bool = True,
              where: str = "options") -> dict[str, Any]:
    """Replace TFRA's keys in ``options`` by tensorkv's option names, in tensorkv's units.

    Parameters
    ----------
    options
        Option names to values; TFRA's keys (:data:`TFRA_KEYS`) are translated, every other
        key is returned unchanged (the caller checks those).
    tfra_defaults
        Fill TFRA's defaults for the table keys it omits (``model_tag_*`` ``"test"``,
        ``storage_slice`` 1, ``table_store_mode`` 1 under ``/tmp/``, a week's expiry) and
        build the URL from TFRA's connection defaults: for a TFRA config file (one without
        ``"url"``).
    servers
        Build ``url`` from TFRA's host keys; False: drop those keys (the servers are named
        elsewhere, e.g. by an explicit URL).
    where
        Where the options came from, for messages.

    Returns
    -------
    dict
        The options with ``url`` (when the servers are named by TFRA's keys), tensorkv's
        store options and the table's options.

    Raises
    ------
    ConfigError
        A TFRA key of the wrong JSON type or out of range, a TFRA key given beside its
        tensorkv twin, or ``url`` beside TFRA's host keys.
    """
    raw = {k: _check(k, v, where) for k, v in options.items()
           if k in TFRA_KEYS and k not in _TABLE_KEYS and (servers or k not in URL_KEYS)}
    out = {k: v for k, v in options.items() if k not in raw and k not in URL_KEYS}
    for key, twin in _TWINS.items():
        if key in raw and twin in out:
            raise ConfigError(f"{key} (TFRA's name) and {twin} (tensorkv's) are both given "
                              f"({where}); keep one")
    if servers and (any(k in raw for k in URL_KEYS) or tfra_defaults):
        if "url" in out:
            named = ", ".join(k for k in URL_KEYS if k in raw)
            raise ConfigError(f"url={out['url']!r} and TFRA's {named} both name the servers "
                              f"({where}); keep one")
        out["url"] = _url(raw, where)
    if tfra_defaults:
        for key in _TABLE_KEYS:
            out.setdefault(key, TFRA_KEYS[key][0])
    for key, (name, factor) in _STORE_KEYS.items():
        if key in raw:
            v = raw[key]
            if factor is not None:
                if v <= 0:
                    raise ConfigError(f"TFRA option {key}={v} ({where}) must be > 0 "
                                      "milliseconds")
                v = v * factor
            elif name == "max_connections" and v < 1:
                raise ConfigError(f"TFRA option {key}={v} ({where}) must be >= 1")
            out[name] = v
    user, password = raw.get("redis_user"), raw.get("redis_password")
    if password:  # TFRA authenticates only with a password; "default" is Redis's own user
        out["password"] = password
        if user and user != "default":
            out["username"] = user
    s_user, s_password = raw.get("redis_sentinel_user"), raw.get("redis_sentinel_password")
    if s_password:
        out["sentinel_password"] = s_password
        if s_user and s_user != "default":
            out["sentinel_username"] = s_user
    for key in _TABLE_KEYS:  # shared names: tensorkv checks the values; TFRA's forms mapped
        if key not in out:
            continue
        v = out[key]
        if key == "storage_slice_import" and _int(v) and v <= 0:  # TFRA: -1 = storage_slice
            del out[key]
        elif key == "expire_model_tag_in_seconds" and _int(v) and v < 0:  # TFRA: never
            out[key] = 0
        elif key.startswith("redis_hash_tags") and isinstance(v, (list, tuple)):
            tags = _tags(v)
            if tags is None:
                del out[key]
            else:
                out[key] = tags
    for key, (neutral, why) in NO_EFFECT.items():
        if key in raw and neutral is not None and raw[key] != neutral:
            warnings.warn(f"TFRA option {key}={raw[key]!r} ({where}) has no effect here: {why}",
                          UserWarning, stacklevel=3)
    return out


# ------------------------------------------------------------------------------ the file
_LENIENT = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/|\bTrue\b|\bFalse\b', re.S)


def _lenient(text: str) -> str:
    """TFRA's documented file as printed: ``//`` comments dropped, Python's True/False."""
    def sub(m: re.Match[str]) -> str:
        s = m.group(0)
        if s.startswith('"'):
            return s
        return {"True": "true", "False": "false"}.get(s, "")
    return _LENIENT.sub(sub, text)


def read_config(path: str, source: str, what: str = "Redis table config file") -> dict[str, Any]:
    """The JSON object in ``path``; TFRA's documented spelling (comments, True) is accepted."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} {path!r} (from {source}) does not exist; fix the path or "
                          "unset it") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path!r} (from {source}) is unreadable: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        try:
            data = json.loads(_lenient(text))
        except ValueError:
            raise ConfigError(f"{what} {path!r} (from {source}) is unreadable: not JSON: "
                              f"{exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path!r} must hold a JSON object of options, not "
                          f"{type(data).__name__}")
    return data


def _env(name: str) -> str | None:
    raw = os.environ.get(name, "").strip()
    return raw or None


def find_table_config(config_path: str | None, config_env: str | None) -> tuple[str, str] | None:
    """Locate a Redis table's JSON config file; return ``(path, where it came from)`` or None.

    Priority: the environment variable named by ``config_env``, then
    ``TENSORKV_REDIS_CONFIG_PATH``, then ``TFRA_REDIS_CONFIG_PATH``, then ``config_path``.
    A variable that is set must name an existing file (as in TFRA).
    """
    if config_env is not None:
        if not isinstance(config_env, str) or not config_env:
            raise ConfigError(f"config_env={config_env!r} must name an environment variable, "
                              "e.g. config_env='MY_REDIS_CONFIG'")
        found = _env(config_env)
        if found:
            return found, f"environment variable {config_env}"
    ours, theirs = _env(config.ENV_REDIS_CONFIG_PATH), _env(ENV_TFRA_REDIS_CONFIG_PATH)
    if ours and theirs and os.path.abspath(ours) != os.path.abspath(theirs):
        warnings.warn(f"{config.ENV_REDIS_CONFIG_PATH}={ours!r} and "
                      f"{ENV_TFRA_REDIS_CONFIG_PATH}={theirs!r} differ; using "
                      f"{config.ENV_REDIS_CONFIG_PATH}", UserWarning, stacklevel=3)
    if ours:
        return ours, f"environment variable {config.ENV_REDIS_CONFIG_PATH}"
    if theirs:
        return theirs, f"environment variable {ENV_TFRA_REDIS_CONFIG_PATH}"
    if config_path:
        return str(config_path), "option config"
    return None


__all__ = ["CLUSTER", "ENV_TFRA_REDIS_CONFIG_PATH", "NO_EFFECT", "SENTINEL", "STANDALONE",
           "TFRA_KEYS", "URL_KEYS", "find_table_config", "read_config", "translate"]
