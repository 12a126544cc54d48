"""``tensorkv bench kv``: put_many / get_many throughput of every backend against the disk.

For each value size (100 B, 4 KiB, 1 MiB) the same random data (16-byte random keys,
incompressible values) goes through

* each backend (``memory``, ``lmdb`` with its defaults and with ``sync=false`` or
  ``readahead=true``, ``rocksdb``, ``leveldb``, and ``redis`` on a throwaway local
  ``redis-server`` without persistence): ``put_many`` in batches, then ``flush()``, into a
  fresh store; then the store is closed and reopened (stores on disk) and ``get_many`` reads
  every key in the same (random) order;
* baseline "files": one file per key in one directory (write every file, then one
  ``os.sync()`` and an ``fsync`` of the directory; read every file back);
* baseline "sequential": the total bytes written to one file and ``fsync``-ed, then read back —
  the disk's own limit.

By default the run reads and writes only its own files and leaves the page cache alone, so
reads may come from it. With ``-p drop_caches=true`` (root only) the whole machine's page
cache is dropped (``/proc/sys/vm/drop_caches``) before every read pass, stores and baselines
alike, so reads come from the disk. The JSON output records ``drop_caches`` and
``page_cache_drops`` (how many times it was dropped). MB/s counts value bytes (1 MB = 10^6 bytes).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property, partial
from typing import Any

import numpy as np

from tensorkv.bench.common import Report, drop_page_cache, measure
from tensorkv.errors import BenchmarkError, ConfigError, MissingDependencyError
from tensorkv.stores import KVStore, open_store
from tensorkv.stores.registry import backend_class

MB = 1_000_000
KEY_BYTES = 16


@dataclass(frozen=True)
class SizeCase:
    """One value size: its label, bytes per value, full-run total bytes and batch size."""

    label: str
    value_bytes: int
    total_bytes: int
    batch: int


SIZE_CASES: tuple[SizeCase, ...] = (
    SizeCase("100B", 100, 50 * MB, 1024),
    SizeCase("4KiB", 4096, 256 * 1024 * 1024, 1024),
    SizeCase("1MiB", 1024 * 1024, 256 * 1024 * 1024, 16),
)

#: Backends measured, in order: label -> (scheme, URL options).
BACKENDS: dict[str, tuple[str, str]] = {
    "memory": ("memory", ""),
    "lmdb": ("lmdb", ""),
    "lmdb sync=false": ("lmdb", "?sync=false"),
    "lmdb readahead=true": ("lmdb", "?readahead=true"),
    "rocksdb": ("rocksdb", ""),
    "leveldb": ("leveldb", ""),
    "redis": ("redis", ""),
}


# ----------------------------------------------------------------------------- environment
def _fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (from /proc/mounts; '' if unknown)."""
    path = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(
                    best
                ):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def bench_root(directory: str | None = None) -> str:
    """Directory for benchmark data: ``directory``, else the temp dir unless it is in memory.

    ``/tmp`` on tmpfs would measure RAM, not the disk, so then the current directory is used.
    """
    if directory is not None:
        return directory
    tmp = tempfile.gettempdir()
    if _fs_type(tmp) in {"tmpfs", "ramfs"}:
        return os.getcwd()
    return tmp


def available_backends(names: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """Split backend labels into the ones that can run here and skip reasons for the rest."""
    ok: list[str] = []
    skipped: dict[str, str] = {}
    for name in names:
        if name not in BACKENDS:
            raise ConfigError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
        scheme = BACKENDS[name][0]
        try:
            backend_class(scheme)
        except MissingDependencyError as exc:
            skipped[name] = str(exc)
            continue
        except ImportError as exc:
            skipped[name] = f"backend module not available ({exc})"
            continue
        if scheme == "redis":
            from tensorkv.bench.redis_server import redis_server_path

            if redis_server_path() is None:
                skipped[name] = "redis-server is not on PATH (apt-get install redis-server)"
                continue
        ok.append(name)
    return ok, skipped


# ----------------------------------------------------------------------------- data
@dataclass
class Data:
    """Keys, values and batches of one size case."""

    case: SizeCase
    keys: list[bytes]
    values: list[bytes]
    blob: bytes  # all values back to back (the sequential baseline writes this)
    put_batches: list[list[tuple[bytes, bytes]]]
    get_batches: list[list[bytes]]

    @property
    def n(self) -> int:
        """Number of keys."""
        return len(self.keys)

    @cached_property
    def file_names(self) -> list[str]:
        """One file name per key (its hex digits), for the one-file-per-key baseline."""
        return [k.hex() for k in self.keys]

    @property
    def value_total(self) -> int:
        """Bytes of all values."""
        return len(self.blob)


def make_data(case: SizeCase, total_bytes: int, seed: int = 0) -> Data:
    """Random 16-byte keys and incompressible values totalling about ``total_bytes``."""
    rng = np.random.default_rng(seed)
    n = max(1, total_bytes // case.value_bytes)
    kb = rng.bytes(KEY_BYTES * n)
    keys = [kb[i : i + KEY_BYTES] for i in range(0, KEY_BYTES * n, KEY_BYTES)]
    vb = case.value_bytes
    blob = rng.bytes(vb * n)
    values = [blob[i : i + vb] for i in range(0, vb * n, vb)]
    b = case.batch
    put_batches = [
        list(zip(keys[i : i + b], values[i : i + b], strict=True)) for i in range(0, n, b)
    ]
    get_batches = [keys[i : i + b] for i in range(0, n, b)]
    return Data(case, keys, values, blob, put_batches, get_batches)


# ----------------------------------------------------------------------------- stores
class _StoreRunner:
    """Opens a fresh store for each write pass and cleans up after itself."""

    def __init__(
        self,
        name: str,
        root: str,
        redis_url: str | None,
        flushall: Callable[[], None],
        drop: Callable[[], None] | None,
    ):
        self.name = name
        self.scheme, self.query = BACKENDS[name]
        self.root = root
        self.redis_url = redis_url
        self.flushall = flushall
        self.drop = drop
        self.store: KVStore | None = None
        self.url = ""
        self._count = 0

    @property
    def on_disk(self) -> bool:
        """Whether the store keeps its data in files (so reads can be cold)."""
        return self.scheme not in {"memory", "redis"}

    def fresh(self) -> None:
        """Close and remove the previous store; open an empty one."""
        self.close()
        if self.scheme == "memory":
            self.url = "memory://"
        elif self.scheme == "redis":
            self.flushall()
            assert self.redis_url is not None
            self.url = self.redis_url
        else:
            self._count += 1
            path = os.path.join(self.root, f"{self.scheme}-{self._count}")
            self.url = f"{self.scheme}://{path}{self.query}"
        self.store = open_store(self.url)
        gc.collect()

    def reopen(self) -> None:
        """Close and reopen a store on disk (dropping the page cache in between if asked).

        Reads then come from the files, not from a memtable or cache left by the writes. An
        in-memory store stays open (closing it would lose the data).
        """
        if self.on_disk:
            assert self.store is not None
            self.store.close()
            self.store = None
            _maybe_drop(self.drop)
            self.store = open_store(self.url)
        # (stores on disk: again, as recovery on open, a log replay, may refill the cache)
        _maybe_drop(self.drop)

    def close(self) -> None:
        """Close the store and delete its files."""
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.on_disk:
            for entry in os.listdir(self.root):
                if entry.startswith(f"{self.scheme}-"):
                    shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)


def _disk_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file removed meanwhile
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
    return total


# ----------------------------------------------------------------------------- baselines
def _files_write(data: Data, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for name, value in zip(data.file_names, data.values, strict=True):
            fd = os.open(name, flags, 0o644, dir_fd=dfd)
            os.write(fd, value)
            os.close(fd)
        os.sync()
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _files_read(data: Data, directory: str) -> int:
    dfd = os.open(directory, os.O_RDONLY)
    total = 0
    size = data.case.value_bytes
    try:
        for name in data.file_names:
            fd = os.open(name, os.O_RDONLY, dir_fd=dfd)
            total += len(os.read(fd, size))
            os.close(fd)
    finally:
        os.close(dfd)
    return total


_SEQ_CHUNK = 8 * 1024 * 1024


def _seq_write(data: Data, path: str) -> None:
    mv = memoryview(data.blob)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for i in range(0, len(mv), _SEQ_CHUNK):
            os.write(fd, mv[i : i + _SEQ_CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def _seq_read(data: Data, path: str, buf: bytearray) -> int:
    mv = memoryview(buf)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while total < len(buf):
            n = f.readinto(mv[total : total + _SEQ_CHUNK])
            if not n:
                break
            total += n
    return total


# ----------------------------------------------------------------------------- the workload
def run(
    quick: bool,
    report: Report,
    *,
    scale: float | None = None,
    sizes: Sequence[str] | str | None = None,
    backends: Sequence[str] | str | None = None,
    repeat: int = 1,
    directory: str | None = None,
    drop_caches: bool = False,
) -> None:
    """Measure put_many/get_many of every backend and the two filesystem baselines.

    Parameters
    ----------
    quick
        Use 1/10 of the full data (about 59 MB of values in all instead of 587 MB).
    report
        Receives the figures.
    scale
        Fraction of the full-run data to use (overrides ``quick``), e.g. ``0.001`` for a
        smoke run.
    sizes
        Value-size labels to run (``"100B"``, ``"4KiB"``, ``"1MiB"``; a comma-separated string
        works too); default all.
    backends
        Backend labels to run, comma-separated (``memory``, ``lmdb``, ``lmdb sync=false``,
        ``lmdb readahead=true``, ``rocksdb``, ``leveldb``, ``redis``); default all.
    repeat
        Timed passes per figure (the best is reported).
    directory
        Where to put the stores and baseline files (default: the temp directory, or the
        current directory when the temp directory is in memory).
    drop_caches
        Drop the whole machine's page cache (``/proc/sys/vm/drop_caches``, root only) before
        each read pass, so reads come from the disk. Off by default: the run then reads and
        writes only its own files, and reads may come from the page cache.
    """
    if isinstance(sizes, str):
        sizes = [s.strip() for s in sizes.split(",") if s.strip()]
    if isinstance(backends, str):
        backends = [b.strip() for b in backends.split(",") if b.strip()]
    frac = float(scale) if scale is not None else (0.1 if quick else 1.0)
    if not 0 < frac <= 10:
        raise ConfigError(f"scale={scale!r} must be in (0, 10], e.g. 0.1")
    if repeat < 1:
        raise ConfigError(f"repeat={repeat!r} must be at least 1")
    if not isinstance(drop_caches, bool):
        raise ConfigError(f"drop_caches={drop_caches!r} must be true or false")
    by_label = {c.label: c for c in SIZE_CASES}
    chosen = list(sizes) if sizes else list(by_label)
    for s in chosen:
        if s not in by_label:
            raise ConfigError(f"unknown size {s!r}; choose from {', '.join(by_label)}")
    names, skipped = available_backends(list(backends) if backends else list(BACKENDS))
    report.params.update({"drop_caches": bool(drop_caches), "page_cache_drops": 0})
    drop = partial(drop_page_cache, report) if drop_caches else None
    _maybe_drop(drop)  # fails here, before any file is written, where it is not permitted
    read_note = "cold cache" if drop else "page cache"
    root_parent = bench_root(directory)
    root = tempfile.mkdtemp(prefix="tensorkv-bench-kv-", dir=root_parent)
    report.params.update(
        {
            "scale": frac,
            "sizes": {
                s: {
                    "value_bytes": by_label[s].value_bytes,
                    "keys": max(1, int(by_label[s].total_bytes * frac) // by_label[s].value_bytes),
                    "batch": by_label[s].batch,
                }
                for s in chosen
            },
            "key_bytes": KEY_BYTES,
            "backends": names,
            "skipped": skipped,
            "directory": root_parent,
            "filesystem": _fs_type(root_parent),
            "reads": "cold: page cache dropped before each read pass (drop_caches=true)"
            if drop
            else "warm: page cache kept (drop_caches=false); reads may hit the page cache",
            "repeat": repeat,
            "mb": "10^6 bytes of values",
            "redis": "local redis-server, no persistence (save '', appendonly no)",
        }
    )
    say = print if report.echo else (lambda *a, **k: None)
    for name, why in skipped.items():
        say(f"  skipping {name}: {why}", flush=True)

    server = None
    try:
        if "redis" in names:
            from tensorkv.bench.redis_server import RedisServer

            server = RedisServer()
        for label in chosen:
            case = by_label[label]
            data = make_data(case, int(case.total_bytes * frac))
            say(
                f"[kv] {label} values: {data.n:,} keys, {data.value_total / MB:,.1f} MB, "
                f"batches of {case.batch}",
                flush=True,
            )
            _run_case(report, data, names, root, server, repeat, drop, read_note)
            del data
            gc.collect()
        say("\n[kv] summary (x seq.: ratio to one sequential file; x files: to one file per key)")
        say(summary_table([asdict(r) for r in report.results]))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _maybe_drop(drop: Callable[[], None] | None) -> None:
    if drop is not None:
        drop()


def _run_case(
    report: Report,
    data: Data,
    names: list[str],
    root: str,
    server: Any,
    repeat: int,
    drop: Callable[[], None] | None,
    read_note: str,
) -> None:
    label = data.case.label
    mb = data.value_total / MB
    n = data.n

    # -- baseline: one sequential file
    seq_path = os.path.join(root, "sequential.bin")
    t = measure(lambda: _seq_write(data, seq_path), repeat=repeat, warmup=0)
    seq_w = mb / t.best
    buf = bytearray(data.value_total)
    got: list[int] = []
    t = measure(
        lambda: got.append(_seq_read(data, seq_path, buf)),
        repeat=repeat,
        warmup=0,
        setup=lambda: _maybe_drop(drop),
    )
    if got[-1] != data.value_total:
        raise BenchmarkError(f"sequential baseline read {got[-1]} of {data.value_total} bytes")
    if bytes(buf[: data.case.value_bytes]) != data.values[0]:
        raise BenchmarkError("sequential baseline read back different bytes")
    seq_r = mb / t.best
    buf[:] = b""  # free it
    os.unlink(seq_path)

    # -- baseline: one file per key
    fdir = os.path.join(root, "files")

    def files_setup() -> None:
        shutil.rmtree(fdir, ignore_errors=True)
        os.sync()

    t = measure(lambda: _files_write(data, fdir), repeat=repeat, warmup=0, setup=files_setup)
    files_w_mb = mb / t.best
    files_w_ops = n / t.best
    got.clear()
    t = measure(
        lambda: got.append(_files_read(data, fdir)),
        repeat=repeat,
        warmup=0,
        setup=lambda: _maybe_drop(drop),
    )
    if got[-1] != data.value_total:
        raise BenchmarkError(f"files baseline read {got[-1]} of {data.value_total} bytes")
    files_r_mb = mb / t.best
    files_r_ops = n / t.best
    shutil.rmtree(fdir, ignore_errors=True)

    w_seq, r_seq = "sequential write+fsync", "sequential read"
    w_files, r_files = "one file per key + sync", "one file per key read"
    report.add(f"files {label} write", "MB/s", files_w_mb, w_seq, seq_w)
    report.add(f"files {label} read", "MB/s", files_r_mb, r_seq, seq_r, note=read_note)

    # -- the stores
    for name in names:
        flushall = server.flushall if server is not None else (lambda: None)
        url = server.url if server is not None else None
        runner = _StoreRunner(name, root, url, flushall, drop)

        def write(runner: _StoreRunner = runner) -> None:
            store = runner.store
            assert store is not None
            for batch in data.put_batches:
                store.put_many(batch)
            store.flush()

        missing: list[int] = []

        def read(runner: _StoreRunner = runner, missing: list[int] = missing) -> None:
            store = runner.store
            assert store is not None
            absent = 0
            for keys in data.get_batches:
                absent += store.get_many(keys).count(None)
            missing.append(absent)

        try:
            tw = measure(write, repeat=repeat, warmup=0, setup=runner.fresh)
            _verify(runner.store, data)
            size_note, get_note = "", "in RAM"
            if runner.on_disk:
                on_disk = _disk_bytes(root)
                size_note = f"{on_disk / data.value_total:.2f}x value bytes on disk"
                get_note = f"{read_note}, store reopened"
            elif runner.scheme == "redis" and server is not None:
                used = server.used_memory() / data.value_total
                size_note = f"{used:.2f}x value bytes in server RAM"
                get_note = "server RAM"
            tr = measure(read, repeat=repeat, warmup=0, setup=runner.reopen)
        finally:
            runner.close()
        if missing and missing[-1]:
            raise BenchmarkError(f"{name}: {missing[-1]} of {n} keys missing on read")
        case = f"{name} {label}"
        report.add(f"{case} put_many", "MB/s", mb / tw.best, w_seq, seq_w, note=size_note)
        report.add(f"{case} put_many", "ops/s", n / tw.best, w_files, files_w_ops)
        report.add(f"{case} get_many", "MB/s", mb / tr.best, r_seq, seq_r, note=get_note)
        report.add(f"{case} get_many", "ops/s", n / tr.best, r_files, files_r_ops)
    report.params.setdefault("files_write_mb_s", {})[label] = files_w_mb
    report.params.setdefault("files_read_mb_s", {})[label] = files_r_mb


def _verify(store: KVStore | None, data: Data) -> None:
    """Check one batch (untimed) came back byte-identical."""
    assert store is not None
    keys = data.get_batches[0]
    got = store.get_many(keys)
    want = data.values[: len(keys)]
    if [None if g is None else bytes(g) for g in got] != want:
        raise BenchmarkError(f"{store!r} returned different bytes than were written")


def summary_table(results: Sequence[dict[str, Any]]) -> str:
    """Pivot the figures of a run (``Report.to_dict()["results"]``) into one Markdown table.

    One row per value size and backend: put_many and get_many throughput, each with its
    ratio to the sequential-file baseline (MB/s) and to the one-file-per-key baseline
    (ops/s); then the two baselines of that size.
    """
    fig: dict[tuple[str, str], dict[str, Any]] = {}
    pairs: list[tuple[str, str]] = []  # (value size, backend) in run order
    for row in results:
        fig[(row["case"], row["metric"])] = row
        parts = row["case"].rsplit(" ", 2)
        ok = len(parts) == 3 and parts[2] in {"put_many", "get_many"}
        if ok and (parts[1], parts[0]) not in pairs:
            pairs.append((parts[1], parts[0]))
    lines = [
        "| values | backend | put MB/s | x seq. write | put ops/s | x files | "
        "get MB/s | x seq. read | get ops/s | x files |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in dict.fromkeys(p[0] for p in pairs):
        for _, name in (p for p in pairs if p[0] == label):
            cells = [label, name]
            for op in ("put_many", "get_many"):
                for metric in ("MB/s", "ops/s"):
                    r = fig.get((f"{name} {label} {op}", metric))
                    cells += ["", ""] if r is None else [_num(r["value"]), f"{r['ratio']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        w = fig.get((f"files {label} write", "MB/s"))
        r = fig.get((f"files {label} read", "MB/s"))
        if w is not None and r is not None:
            lines.append(
                f"| {label} | *one file per key* | {_num(w['value'])} | {w['ratio']:.2f} | | | "
                f"{_num(r['value'])} | {r['ratio']:.2f} | | |"
            )
            lines.append(
                f"| {label} | *sequential file* | {_num(w['baseline_value'])} | 1.00 | | | "
                f"{_num(r['baseline_value'])} | 1.00 | | |"
            )
    return "\n".join(lines)


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"
