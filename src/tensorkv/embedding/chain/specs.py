"""Storage options of an embedding table: which tiers hold its rows, how big each is.

:class:`StorageOption` takes DeepRec's names (``"DRAM_SSDHASH"``) or explicit tier specs
(:class:`DRAM`, :class:`HBM`, :class:`PMEM`, :class:`SSDHash`, :class:`KV`). Configuration
only: :meth:`StorageOption.tier_specs` returns validated specs and a lower-tier spec's
:meth:`~LowerTierSpec.open` opens its tier. Spill paths: a relative path is resolved against
the working directory when the spec is made; no path means a fresh temporary directory,
removed when the tier closes. See docs/tiers.md ("StorageOption", "Spill directories").
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tensorkv import config
from tensorkv.errors import ConfigError

if TYPE_CHECKING:
    from tensorkv.embedding.redis.options import RedisTableOptions
    from tensorkv.embedding.tiers.base import LowerTier, RecordLayout

CACHE_STRATEGIES = ("lfu", "lru")


def _size(value: int | str | None, what: str) -> int | None:
    return None if value is None else config.parse_size(value, what=what)


@dataclass(frozen=True)
class TierSpec:
    """One tier of a storage chain. ``size`` is its capacity in bytes (None: unbounded)."""

    size: int | str | None = None
    kind: ClassVar[str] = ""
    rank: ClassVar[int] = 0  # tiers must appear in increasing rank (fast to slow)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size(self.size, f"{self.kind} size"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (see :func:`spec_from_dict`)."""
        return {"kind": self.kind, **asdict(self)}


@dataclass(frozen=True)
class HBM(TierSpec):
    """GPU memory (tier 0 of a GPU table)."""

    kind: ClassVar[str] = "HBM"
    rank: ClassVar[int] = 0


@dataclass(frozen=True)
class DRAM(TierSpec):
    """Host memory (tier 0 of a CPU table, or below HBM)."""

    kind: ClassVar[str] = "DRAM"
    rank: ClassVar[int] = 1


@dataclass(frozen=True)
class LowerTierSpec(TierSpec):
    """A tier below memory; it can open its :class:`~tensorkv.embedding.tiers.LowerTier`."""

    @property
    def location(self) -> str | None:  # pragma: no cover - defined by the tiers
        """The absolute path or URL of the tier's data (None: a temporary directory)."""
        raise NotImplementedError

    def open(self, layout: RecordLayout, **overrides: Any) -> LowerTier:  # pragma: no cover
        """Open (or create) this tier for records of ``layout``.

        ``overwrite=True`` (an override every lower tier takes) wipes the tier data already
        at its location first.
        """
        raise NotImplementedError


#: Embedded stores a KV tier may put in a temporary directory (``KV("lmdb://")``).
TEMP_SCHEMES = ("leveldb", "lmdb", "rocksdb")


def _spill_path(kind: str, path: object) -> str | None:
    """``path`` resolved against the working directory (None: a temporary directory)."""
    if path is None:
        return None
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(
            f"{kind} tier takes a path (a directory or file on the device) or None for a "
            f"temporary directory, got {path!r}; e.g. {kind}('/data/emb')"
        )
    return os.path.abspath(os.fspath(path))


def _open_spill(path: str | None, opener: Callable[[str], LowerTier],
                leaf: str | None = None) -> LowerTier:
    """``opener(path)``, or the tier in a new temporary directory removed when it closes."""
    if path is not None:
        return opener(path)
    tmp = tempfile.mkdtemp(prefix="tensorkv-spill-")
    try:
        tier = opener(os.path.join(tmp, leaf) if leaf else tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tier.remove_on_close(tmp)
    return tier


@dataclass(frozen=True, init=False)
class PMEM(LowerTierSpec):
    """Persistent memory: a memory-mapped slot file on a DAX mount (None: a temporary file)."""

    path: str | None = None
    kind: ClassVar[str] = "PMEM"
    rank: ClassVar[int] = 2

    def __init__(self, path: str | os.PathLike[str] | None = None,
                 size: int | str | None = None) -> None:
        object.__setattr__(self, "path", _spill_path("PMEM", path))
        object.__setattr__(self, "size", size)
        self.__post_init__()

    @property
    def location(self) -> str | None:
        """The slot file's absolute path (None: a temporary file)."""
        return self.path

    def open(self, layout: RecordLayout, **overrides: Any) -> LowerTier:
        """Open a :class:`~tensorkv.embedding.tiers.pmem.PMEMTier` at ``path``."""
        from tensorkv.embedding.tiers.pmem import PMEMTier

        return _open_spill(
            self.path, lambda p: PMEMTier(p, layout, **{"max_bytes": self.size, **overrides}),
            leaf="pmem.tier")


@dataclass(frozen=True, init=False)
class SSDHash(LowerTierSpec):
    """The SSDHASH tier: append-only segments with an in-memory index in a directory.

    ``path=None``: a temporary directory, removed when the tier closes.
    """

    path: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "SSDHASH"
    rank: ClassVar[int] = 3

    def __init__(
        self, path: str | os.PathLike[str] | None = None, size: int | str | None = None,
        **options: Any,
    ) -> None:
        object.__setattr__(self, "path", _spill_path("SSDHash", path))
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "options", dict(options))
        self.__post_init__()

    @property
    def location(self) -> str | None:
        """The directory's absolute path (None: a temporary directory)."""
        return self.path

    def open(self, layout: RecordLayout, **overrides: Any) -> LowerTier:
        """Open a :class:`~tensorkv.embedding.tiers.ssdhash.SSDHashTier` at ``path``."""
        from tensorkv.embedding.tiers.ssdhash import SSDHashTier

        return _open_spill(
            self.path, lambda p: SSDHashTier(p, layout, **{**self.options, **overrides}))


@dataclass(frozen=True, init=False)
class KV(LowerTierSpec):
    """Any key-value store URL as a tier (``rocksdb:///data/emb``, ``redis://host:6379/0``).

    An embedded store's URL without a path (``"lmdb://"``, ``"rocksdb://"``,
    ``"leveldb://"``) names a store in a temporary directory, removed when the tier closes.
    """

    url: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    kind: ClassVar[str] = "KV"
    rank: ClassVar[int] = 3

    def __init__(self, url: str, size: int | str | None = None, **options: Any) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(
                f"KV needs a store URL such as 'rocksdb:///data/emb' or "
                f"'redis://localhost:6379/0', got {url!r}"
            )
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "options", dict(options))
        self.__post_init__()

    @property
    def location(self) -> str | None:
        """The store URL (None: a store in a temporary directory)."""
        return None if self.url[:-3] in TEMP_SCHEMES and self.url.endswith("://") else self.url

    def open(self, layout: RecordLayout, **overrides: Any) -> LowerTier:
        """Open a :class:`~tensorkv.embedding.tiers.kv.KVTier` over ``url``."""
        from tensorkv.embedding.tiers.kv import KVTier

        scheme = self.url.split("://", 1)[0]
        return _open_spill(
            None if self.location is None else self.url,
            lambda p: KVTier(p if "://" in p else f"{scheme}://{p}", layout,
                             **{**self.options, **overrides}))


_SPEC_CLASSES: dict[str, type[TierSpec]] = {c.kind: c for c in (HBM, DRAM, PMEM, SSDHash, KV)}


def spec_from_dict(d: dict[str, Any]) -> TierSpec:
    """Rebuild a spec from :meth:`TierSpec.to_dict` output."""
    d = dict(d)
    cls = _SPEC_CLASSES.get(str(d.pop("kind", "")))
    if cls is None:
        raise ConfigError(f"unknown tier kind in {d!r}; known: {sorted(_SPEC_CLASSES)}")
    opts = d.pop("options", {})
    return cls(**d, **opts)


# --------------------------------------------------------------------------- DeepRec names
_KV_SCHEMES = {"LEVELDB": "leveldb", "ROCKSDB": "rocksdb", "LMDB": "lmdb", "REDIS": "redis"}
_TOPS = {"DRAM": ("DRAM",), "HBM": ("HBM",), "HBM_DRAM": ("HBM", "DRAM")}
_LOWERS = {"": (), "PMEM": ("PMEM",), "SSDHASH": ("SSDHASH",), "PMEM_SSDHASH": ("PMEM", "SSDHASH"),
           **{k: (k,) for k in _KV_SCHEMES},
           **{f"PMEM_{k}": ("PMEM", k) for k in _KV_SCHEMES if k != "REDIS"}}  # fmt: skip
STORAGE_TYPES: dict[str, tuple[str, ...]] = {
    (top + ("_" + low if low else "")): t + lo
    for top, t in _TOPS.items()
    for low, lo in _LOWERS.items()
}


def _names() -> str:
    return ", ".join(STORAGE_TYPES)


def _inside(path: Any, leaf: str, n_device: int) -> Any:
    """A device tier's path: ``path`` itself, or ``path/leaf`` when two tiers share it."""
    return os.path.join(os.fspath(path), leaf) if path is not None and n_device > 1 else path


class StorageOption:
    """Where an embedding table keeps its rows: a chain of tiers, fastest first.

    Parameters
    ----------
    storage_type
        A DeepRec-style name such as ``"DRAM"``, ``"HBM_DRAM"``, ``"DRAM_SSDHASH"``,
        ``"DRAM_LEVELDB"``, ``"DRAM_PMEM_SSDHASH"``, ``"HBM_DRAM_SSDHASH"``, ``"DRAM_ROCKSDB"``,
        ``"DRAM_LMDB"``, ``"DRAM_REDIS"``, ``"DRAM_PMEM_LEVELDB"``, ``"HBM_DRAM_PMEM_LEVELDB"``
        (case-insensitive; every one of DeepRec's 13 names, docs/tiers.md lists them all).
        Ignored when ``tiers`` is given.
        ``"REDIS"``: a table whose rows live in Redis, shared by every process that opens
        the same options (docs/redis_table.md); ``storage_path`` is the Redis URL or a JSON
        config file.
    storage_path
        Directory of the on-device tier(s) (for two such tiers, ``pmem.tier`` and
        ``ssdhash/`` or ``leveldb/``... inside it), or a store URL; for ``*_REDIS`` the Redis
        URL. A relative path is resolved against the working directory now (``stats()`` and
        errors give the absolute one); None (not for ``*_REDIS``): a fresh temporary
        directory, removed on close.
    storage_size
        Capacity of each tier in order, in bytes or strings like ``"4GiB"`` (DeepRec's
        ``storage_size``). A tier without an entry holds DeepRec's default, 1 GiB
        (:data:`tensorkv.config.DEEPREC_TIER_SIZE`), except the last tier, which has nowhere
        to move rows to and is unbounded. ``None`` inside the list: that tier is unbounded.
    cache_strategy
        How tier 0 picks rows to move down: ``"lfu"`` (frequency) or ``"lru"`` (recency).
    tiers
        Explicit specs, e.g. ``[DRAM("4GiB"), SSDHash("/data/emb"), KV("rocksdb:///db")]``.
    overwrite
        Wipe the tier data already at the lower tiers' paths (an earlier table's spill
        space) and start empty. Without it, a table refuses a path holding rows
        (:class:`~tensorkv.errors.SpillDataExistsError`); spill data is never reopened as a
        table, since the rows held in memory at close, the step and the optimizer state
        are not in it (checkpoints keep a table).
    redis_options
        With ``storage_type="REDIS"``: the table's options
        (:class:`~tensorkv.embedding.redis.options.RedisTableOptions`: ``table_name``,
        ``model_tag_runtime``, ``storage_slice``, ``consistency``...) and Redis store
        options (``password``, ``ssl_ca_certs``...), overriding a config file's.

    Examples
    --------
    >>> opt = StorageOption("DRAM_SSDHASH", storage_path="/data/emb", storage_size=["1GiB"])
    >>> [t.kind for t in opt.tier_specs()]
    ['DRAM', 'SSDHASH']
    """

    def __init__(
        self,
        storage_type: str = "DRAM",
        storage_path: str | os.PathLike[str] | None = None,
        storage_size: list[int | str] | tuple[int | str, ...] | int | str | None = None,
        cache_strategy: str = "lfu",
        tiers: list[TierSpec] | None = None,
        overwrite: bool = False,
        redis_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(cache_strategy, str) or cache_strategy.lower() not in CACHE_STRATEGIES:
            raise ConfigError(
                f"cache_strategy={cache_strategy!r} is not one of {', '.join(CACHE_STRATEGIES)}"
            )
        self.cache_strategy = cache_strategy.lower()
        if not isinstance(overwrite, bool):
            raise ConfigError(f"overwrite={overwrite!r} must be True or False")
        self.overwrite = overwrite
        #: The options of a Redis-resident table (``storage_type="REDIS"``), else None.
        self.redis: RedisTableOptions | None = None
        if tiers is None and isinstance(storage_type, str) and storage_type.upper() == "REDIS":
            if storage_size is not None:
                raise ConfigError("storage_type='REDIS' keeps every row in Redis: drop "
                                  "storage_size (a read cache is redis_options="
                                  "{'read_only': True, 'read_cache_rows': N})")
            from tensorkv.embedding.redis.options import resolve_table_options

            self.redis = resolve_table_options(storage_path, redis_options)
            self.storage_type: str | None = "REDIS"
            self.storage_path: str | None = self.redis.url
            self._specs: list[TierSpec] = [DRAM()]  # the working set of each operation
            return
        if redis_options is not None:
            raise ConfigError("redis_options is for storage_type='REDIS' (a table whose rows "
                              "live in Redis); DRAM_REDIS spills to a Redis URL given as "
                              "storage_path")
        if tiers is not None:
            if storage_path is not None or storage_size is not None:
                raise ConfigError(
                    "give either tiers=[...] or storage_type/storage_path/storage_size, not both; "
                    "put sizes and paths into the tier specs"
                )
            self.storage_type = None
            self._specs = list(tiers)
        else:
            self.storage_type = self._check_name(storage_type)
            if storage_path is not None and not isinstance(storage_path, (str, os.PathLike)):
                raise ConfigError(f"storage_path={storage_path!r} must be a path or a URL")
            if storage_path is not None and "://" not in os.fspath(storage_path):
                storage_path = _spill_path("storage_path", storage_path)
            self._specs = self._from_name(self.storage_type, storage_path, storage_size)
        self.storage_path = None if storage_path is None else os.fspath(storage_path)
        validate_chain(self._specs)

    @staticmethod
    def _check_name(name: object) -> str:
        if not isinstance(name, str) or name.upper() not in STORAGE_TYPES:
            raise ConfigError(f"unknown storage_type {name!r}; valid names: {_names()}")
        return name.upper()

    @staticmethod
    def _from_name(name: str, path: Any, sizes: Any) -> list[TierSpec]:
        kinds = STORAGE_TYPES[name]
        if sizes is None:
            sizes = []
        elif isinstance(sizes, (int, str)):
            sizes = [sizes]
        sizes = list(sizes)
        if len(sizes) > len(kinds):
            raise ConfigError(
                f"storage_size has {len(sizes)} entries but {name} has {len(kinds)} tiers "
                f"({', '.join(kinds)}); give at most one size per tier"
            )
        sizes += [config.DEEPREC_TIER_SIZE] * (len(kinds) - 1 - len(sizes))
        sizes += [None] * (len(kinds) - len(sizes))
        device = [k for k in kinds if k not in ("HBM", "DRAM")]
        if "REDIS" in device and path is None:
            raise ConfigError(f"storage_type {name} keeps rows in Redis and needs storage_path "
                              "(the Redis URL, e.g. 'redis://localhost:6379/0')")
        specs: list[TierSpec] = []
        for kind, size in zip(kinds, sizes, strict=True):
            if kind == "HBM":
                specs.append(HBM(size))
            elif kind == "DRAM":
                specs.append(DRAM(size))
            elif kind == "PMEM":
                specs.append(PMEM(_inside(path, "pmem.tier", len(device)), size))
            elif kind == "SSDHASH":
                specs.append(SSDHash(_inside(path, "ssdhash", len(device)), size))
            elif kind == "REDIS":
                if not isinstance(path, str) or not path.startswith(("redis", "rediss")):
                    raise ConfigError(
                        f"storage_type {name} takes the Redis URL as storage_path, got {path!r};"
                        " e.g. 'redis://localhost:6379/0'"
                    )
                specs.append(KV(path, size))
            elif path is not None and "://" in os.fspath(path):
                if len(device) > 1:
                    raise ConfigError(f"storage_type {name} keeps a PMEM tier beside {kind} and "
                                      f"takes a directory as storage_path, not the URL {path!r}")
                specs.append(KV(os.fspath(path), size))
            else:  # a directory (absolute by now), or None: a temporary one
                where = _inside(path, kind.lower(), len(device))
                specs.append(KV(f"{_KV_SCHEMES[kind]}://{where or ''}", size))
        return specs

    def tier_specs(self) -> list[TierSpec]:
        """The validated tier specs, fastest first."""
        return list(self._specs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (see :meth:`from_dict`)."""
        if self.redis is not None:
            return {"storage_type": "REDIS", "redis": self.redis.to_dict(),
                    "cache_strategy": self.cache_strategy, "tiers": [], "overwrite": False}
        return {
            "storage_type": self.storage_type,
            "cache_strategy": self.cache_strategy,
            "tiers": [s.to_dict() for s in self._specs],
            "overwrite": self.overwrite,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StorageOption:
        """Rebuild from :meth:`to_dict` output."""
        if d.get("redis") is not None:
            r = dict(d["redis"])
            r.update(r.pop("store_options", None) or {})
            return cls("REDIS", storage_path=r.pop("url"), redis_options=r)
        opt = cls(tiers=[spec_from_dict(t) for t in d["tiers"]], cache_strategy=d["cache_strategy"],
                  overwrite=bool(d.get("overwrite", False)))
        opt.storage_type = d.get("storage_type")
        return opt

    def __repr__(self) -> str:
        if self.redis is not None:
            r = self.redis
            return (f"StorageOption('REDIS', storage_path={r.url!r}, model_tag_runtime="
                    f"{r.model_tag_runtime!r}, table_name={r.table_name!r})")
        inner = ", ".join(repr(s) for s in self._specs)
        more = ", overwrite=True" if self.overwrite else ""
        return f"StorageOption(tiers=[{inner}], cache_strategy={self.cache_strategy!r}{more})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StorageOption):
            return NotImplemented
        if self.redis is not None or other.redis is not None:
            return self.redis == other.redis
        return self.to_dict()["tiers"] == other.to_dict()["tiers"] and (
            self.cache_strategy == other.cache_strategy
        )

    __hash__ = None  # type: ignore[assignment]


def validate_chain(specs: list[TierSpec]) -> None:
    """Refuse impossible tier chains with a ConfigError naming the valid shapes."""
    shapes = "valid chains: [HBM] [DRAM] [HBM, DRAM] then optionally PMEM, then SSDHash or KV"
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"tiers must be a non-empty list of tier specs; {shapes}")
    for s in specs:
        if not isinstance(s, TierSpec) or type(s) in (TierSpec, LowerTierSpec):
            raise ConfigError(
                f"tier {s!r} is not a tier spec; use DRAM, HBM, PMEM, SSDHash or KV ({shapes})"
            )
    if specs[0].rank > DRAM.rank:
        raise ConfigError(
            f"the first tier is {specs[0].kind}; rows are read and updated in memory, so the "
            f"chain must start with DRAM or HBM ({shapes}; names: {_names()})"
        )
    for a, b in zip(specs, specs[1:], strict=False):
        if b.rank <= a.rank:
            why = "appears twice" if b.kind == a.kind else f"cannot sit below {a.kind}"
            raise ConfigError(
                f"tier {b.kind} {why}: tiers go fastest first, each kind at most once, and at most"
                f" one of SSDHash/KV ({shapes}; names: {_names()})"
            )


__all__ = ["DRAM", "HBM", "KV", "PMEM", "STORAGE_TYPES", "TEMP_SCHEMES", "LowerTierSpec",
           "SSDHash", "StorageOption", "TierSpec", "spec_from_dict", "validate_chain"]
