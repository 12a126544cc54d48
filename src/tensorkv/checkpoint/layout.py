"""Key naming of checkpoints inside a KVStore, and the stable key hash used for sharding.

Every key a checkpoint writes starts with ``ckpt/`` (see the "Checkpoint layout" section of
``docs/format.md``)::

    ckpt/m/<tag>                            manifest of a complete tag (written last)
    ckpt/r/<tag>                            run record of a sharded save in progress (JSON)
    ckpt/s/<tag>/<token>/<shard>            manifest of one finished shard of run <token>
    ckpt/p/<tag>/<shard>                    pending-save marker (JSON: start time, pid, host)
    ckpt/c/<xxh3-128 hex>                   one dense chunk, content-addressed (shared by tags)
    ckpt/t/<tag>/<table>/<shard>/b/<n>      one block of table rows
    ckpt/t/<tag>/<table>/<shard>/k/<n>      the table's sorted key list (full saves), in pieces
    ckpt/t/<tag>/<table>/<shard>/a/<n>      keys added since the parent (incremental saves)
    ckpt/t/<tag>/<table>/<shard>/r/<n>      keys removed since the parent (incremental saves)

A sharded save writes its table records under the data tag ``<tag>~r<token>`` and its
markers under ``ckpt/p/<tag>~r<token>/<shard>``, so two runs of one tag never share a key.
Manifests of shards written before run ids existed sit at ``ckpt/s/<tag>/<shard>``.

With ``hash_tag`` set, table keys carry a Redis Cluster hash tag ``{...}`` so that all keys of
a table (``hash_tag="table"``), of one bucket (``"bucket"``) or of the whole checkpoint (any
other string, used literally) land in the same cluster slot.
"""

from __future__ import annotations

import numpy as np

from tensorkv.errors import CheckpointError

PREFIX = b"ckpt/"
MANIFEST = PREFIX + b"m/"
SHARD_MANIFEST = PREFIX + b"s/"
RUN = PREFIX + b"r/"
RUN_MARK = "~r"  # data tag of a sharded run: <tag>~r<token>
PENDING = PREFIX + b"p/"
CHUNK = PREFIX + b"c/"
TABLE = PREFIX + b"t/"

_BAD_NAME_CHARS = ("/", "{", "}", "~", "\x00")  # '~' marks internal data tags


def check_tag(tag: object) -> str:
    """Validate a tag name: a non-empty str without ``/``, ``~``, braces or NUL, not ``latest``."""
    if not isinstance(tag, str) or not tag:
        raise CheckpointError(f"tag {tag!r} must be a non-empty str such as 'step-100'")
    bad = [c for c in _BAD_NAME_CHARS if c in tag]
    if bad:
        raise CheckpointError(
            f"tag {tag!r} contains {bad[0]!r}; use letters, digits, '-', '_', '.'"
        )
    if tag == "latest":
        raise CheckpointError("'latest' is reserved (it names the newest tag); choose another tag")
    if len(tag.encode()) > 200:
        raise CheckpointError(f"tag {tag[:40]!r}... is longer than 200 bytes")
    return tag


def check_var_name(name: object) -> str:
    """Validate a variable (tensor or table) name."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"variable name {name!r} must be a non-empty str")
    if any(c in name for c in ("{", "}", "\x00")):
        raise CheckpointError(f"variable name {name!r} may not contain braces or NUL")
    return name


def manifest_key(tag: str) -> bytes:
    """Key of the manifest of ``tag``."""
    return MANIFEST + tag.encode()


def shard_manifest_key(tag: str, shard: int) -> bytes:
    """Key of the manifest of one finished shard as written before run ids (read only)."""
    return SHARD_MANIFEST + tag.encode() + b"/%06d" % shard


def run_key(tag: str) -> bytes:
    """Key of the run record of a sharded save of ``tag`` in progress."""
    return RUN + tag.encode()


def run_parts_prefix(tag: str, token: str) -> bytes:
    """Prefix of the manifests of the finished shards of run ``token`` of ``tag``."""
    return SHARD_MANIFEST + tag.encode() + b"/" + token.encode() + b"/"


def run_part_key(tag: str, token: str, shard: int) -> bytes:
    """Key of the manifest of shard ``shard`` of run ``token`` of ``tag``."""
    return run_parts_prefix(tag, token) + b"%06d" % shard


def run_data_tag(tag: str, token: str) -> str:
    """The data tag a sharded run writes its table records (and markers) under."""
    return f"{tag}{RUN_MARK}{token}"


def split_data_tag(data_tag: str) -> tuple[str, str | None]:
    """``(tag, run token)`` of a sharded run's data tag; ``(data_tag, None)`` for others."""
    tag, mark, token = data_tag.rpartition(RUN_MARK)
    if not mark or not tag or "~" in tag:
        return data_tag, None
    return tag, token


def parse_part_key(key: bytes) -> tuple[str, str | None, int]:
    """``(tag, run token or None for the old layout, shard)`` of a shard manifest key."""
    parts = bytes(key[len(SHARD_MANIFEST) :]).decode().split("/")
    if len(parts) == 2:
        return parts[0], None, int(parts[1])
    return parts[0], parts[1], int(parts[2])


def pending_key(tag: str, shard: int) -> bytes:
    """Key of the pending-save marker of one shard of ``tag``."""
    return PENDING + tag.encode() + b"/%06d" % shard


def chunk_key(digest_hex: str) -> bytes:
    """Key of a content-addressed dense chunk."""
    return CHUNK + digest_hex.encode()


def _escape(name: str) -> bytes:
    # '/' inside a table name would break prefix scans; escape it.
    return name.replace("%", "%25").replace("/", "%2F").encode()


def table_prefix(tag: str, table: str, shard: int, hash_tag: str | None = None) -> bytes:
    """Prefix of every key of one table shard at ``tag``.

    Parameters
    ----------
    hash_tag
        None, ``"table"``, ``"bucket"`` (the bucket part is added by :func:`block_key`) or a
        literal string put inside ``{}``.
    """
    t = tag.encode()
    n = _escape(table)
    if hash_tag is None or hash_tag == "bucket":
        return TABLE + t + b"/" + n + b"/%06d/" % shard
    if hash_tag == "table":
        return TABLE + b"{" + t + b"/" + n + b"}/%06d/" % shard
    return TABLE + b"{" + hash_tag.encode() + b"}/" + t + b"/" + n + b"/%06d/" % shard


def tag_table_prefix(tag: str, hash_tag: str | None = None) -> bytes:
    """Prefix of every table key of ``tag`` (for deletion)."""
    t = tag.encode()
    if hash_tag is None or hash_tag == "bucket":
        return TABLE + t + b"/"
    if hash_tag == "table":
        return TABLE + b"{" + t + b"/"
    return TABLE + b"{" + hash_tag.encode() + b"}/" + t + b"/"


def block_key(prefix: bytes, n: int, bucket: int, hash_tag: str | None = None) -> bytes:
    """Key of table block ``n`` (rows of hash bucket ``bucket``) under a table prefix."""
    if hash_tag == "bucket":
        return prefix + b"b/{%s%02x}/%08d" % (prefix[len(TABLE):], bucket, n)
    return prefix + b"b/%02x/%08d" % (bucket, n)


def keys_key(prefix: bytes, n: int) -> bytes:
    """Key of piece ``n`` of a table's key list."""
    return prefix + b"k/%08d" % n


# ----------------------------------------------------------------------------- hashing
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(keys: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of int64 keys, as uint64 (stable across versions/platforms).

    ``z = key + 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
    z = (z ^ z>>27) * 0x94D049BB133111EB; z ^= z>>31`` (all mod 2**64).
    """
    z = np.asarray(keys).astype(np.int64, copy=False).view(np.uint64) + _GOLD
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def shard_of_hash(h: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard of each hash: ``floor(h * num_shards / 2**64)`` (a range partition of the hash).

    Computed exactly in 64-bit integers for ``num_shards < 2**31``. Shard ``i`` owns the hash
    range ``[ceil(i * 2**64 / N), ceil((i+1) * 2**64 / N))``, so a block whose hashes are known
    to lie in ``[lo, hi]`` is needed only by the shards ``shard_of_hash(lo) .. shard_of_hash(hi)``.
    """
    if not 0 < num_shards < 2**31:
        raise CheckpointError(f"num_shards={num_shards} must be between 1 and 2**31-1")
    h = np.asarray(h, dtype=np.uint64)
    n = np.uint64(num_shards)
    hi = h >> np.uint64(32)
    lo = h & np.uint64(0xFFFFFFFF)
    return ((hi * n + ((lo * n) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)


def shard_of_keys(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard of each int64 key for ``num_shards`` shards: ``shard_of_hash(splitmix64(key))``."""
    return shard_of_hash(splitmix64(keys), num_shards)


def bucket_of_hash(h: np.ndarray, bucket_bits: int) -> np.ndarray:
    """Hash bucket of each hash: its top ``bucket_bits`` bits."""
    if bucket_bits == 0:
        return np.zeros(np.shape(h), dtype=np.int64)
    return (np.asarray(h, dtype=np.uint64) >> np.uint64(64 - bucket_bits)).astype(np.int64)
