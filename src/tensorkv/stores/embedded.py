"""Helpers shared by the embedded (file-based) backends: LMDB, RocksDB and LevelDB.

Kept free of any optional dependency so each backend module imports only its own binding.
"""

from __future__ import annotations

import ast
import errno
import fnmatch
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tensorkv import config
from tensorkv.errors import (
    ConfigError,
    CorruptStoreError,
    InvalidURLError,
    StoreError,
    StoreFullError,
    StoreLockedError,
    StoreNotFoundError,
    StorePathError,
    StorePermissionError,
)

if TYPE_CHECKING:
    from tensorkv.stores.base import WriteOp
    from tensorkv.stores.url import StoreURL

# ----------------------------------------------------------------------------- URL paths


def store_path(parsed: StoreURL) -> str:
    """Return the absolute filesystem path of an embedded store URL.

    ``lmdb:///data/db`` names ``/data/db``. ``lmdb://data/db`` (two slashes) would put
    ``data`` in the host position; that is refused with the fix spelled out.
    """
    scheme = parsed.scheme
    example = f"{scheme}:///abs/path"
    if parsed.hosts or parsed.username or parsed.password:
        netloc = parsed.url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
        raise InvalidURLError(
            f"store URL {parsed.url!r} names a host or relative path {netloc!r}; {scheme} "
            f"stores are local directories given by an absolute path: use {example} "
            f"(three slashes), e.g. {scheme}:///{netloc}{parsed.path}"
        )
    path = parsed.path
    if not path or path == "/":
        raise InvalidURLError(
            f"store URL {parsed.url!r} has no path; use {example} (a directory for the store)"
        )
    if not os.path.isabs(path):
        raise InvalidURLError(
            f"store URL {parsed.url!r}: path {path!r} is not absolute; use {example}"
        )
    return os.path.normpath(path)


def prepare_directory(
    path: str,
    *,
    readonly: bool,
    marker: str,
    scheme: str,
    create: bool = True,
    data_files: tuple[str, ...] = (),
    repair: str | None = None,
) -> None:
    """Check (and for writers, create) a store directory, with errors that name the path.

    Parameters
    ----------
    path
        The store directory.
    readonly
        Read-only opens need an existing store; writers create the directory.
    marker
        A file that exists inside every store of this backend (e.g. ``data.mdb``).
    scheme
        The URL scheme, for messages.
    create
        False: a missing store raises StoreNotFoundError and nothing is created.
    data_files
        Patterns (``fnmatch``) of files that hold a store's data: a directory with such a
        file but no ``marker`` is a damaged store (CorruptStoreError), never a new one.
    repair
        The binding's repair call, named in the advice of a CorruptStoreError.
    """
    if not os.path.exists(os.path.join(path, marker)):
        found = _matching_files(path, data_files)
        if found:
            shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise corrupt_error(
                scheme,
                path,
                f"{marker} is missing but the directory holds {len(found)} data file(s) "
                f"({shown}): it was deleted or lost; opening it would start an empty store "
                "beside the data",
                repair=repair,
            )
        if readonly or not create:
            what = "does not exist" if not os.path.exists(path) else f"holds no {marker}"
            how = (
                "a read-only open needs an existing store: open it once with readonly=False "
                "to create it"
                if readonly
                else "nothing was created: check the path, or open it with create=True to "
                "make a new store"
            )
            raise StoreNotFoundError(
                errno.ENOENT, f"no {scheme} store at {path!r} ({path!r} {what}); {how}", path
            )
    if readonly:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except PermissionError as exc:
        raise StorePermissionError(
            exc.errno,
            f"cannot create the {scheme} store directory {path!r}: permission denied "
            f"({exc.strerror}); choose a writable location or open an existing store with "
            "readonly=True",
            path,
        ) from exc
    except (FileExistsError, NotADirectoryError) as exc:
        raise StorePathError(
            exc.errno,
            f"cannot create the {scheme} store directory {path!r}: {exc.strerror} "
            f"({exc.filename!r} is a file, not a directory); choose another path",
            path,
        ) from exc
    except OSError as exc:
        if exc.errno == errno.EROFS:
            raise StorePermissionError(
                exc.errno,
                f"cannot create the {scheme} store directory {path!r}: the filesystem is "
                "read-only; open it with readonly=True or choose another path",
                path,
            ) from exc
        raise StorePathError(
            exc.errno, f"cannot create the {scheme} store directory {path!r}: {exc.strerror}", path
        ) from exc
    if not os.path.isdir(path):
        raise StorePathError(
            errno.ENOTDIR, f"{scheme} store path {path!r} is a file, not a directory", path
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorePermissionError(
            errno.EACCES,
            f"the {scheme} store directory {path!r} is not writable by this process; fix its "
            "permissions or open it with readonly=True",
            path,
        )


def _matching_files(path: str, patterns: tuple[str, ...]) -> list[str]:
    if not patterns or not os.path.isdir(path):
        return []
    out = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        matches = any(fnmatch.fnmatch(name, p) for p in patterns) and os.path.isfile(full)
        if matches and (not name.endswith(".log") or os.path.getsize(full)):  # empty log: none
            out.append(name)
    return out


# ----------------------------------------------------------------------------- damage


def corrupt_error(
    scheme: str, path: str, problem: str, *, repair: str | None = None
) -> CorruptStoreError:
    """A CorruptStoreError naming the store, what is wrong, and how to recover.

    Parameters
    ----------
    scheme, path
        The store.
    problem
        What is wrong, naming the file.
    repair
        The binding's repair call (RocksDB, LevelDB), offered when no copy exists.
    """
    salvage = (
        f"; with no copy left, `{repair}` run on a copy of the directory salvages what it "
        "can (it may drop damaged records: verify the result)"
        if repair
        else ""
    )
    return CorruptStoreError(
        f"the {scheme} store {path!r} is damaged: {problem}. Restore the directory from a "
        f"backup or a replica (or an earlier copy of it), then run `tensorkv check --verify "
        f"{scheme}://{path}` to confirm the checkpoints in it{salvage}"
    )


def binding_message(exc: BaseException) -> str:
    """The text of a binding's exception (plyvel's arrive as ``b'...'`` reprs)."""
    text = str(exc)
    if text[:2] in ("b'", 'b"'):
        try:
            raw = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
        if isinstance(raw, bytes):
            return raw.decode("utf-8", "replace")
    return text


#: Words in RocksDB's and LevelDB's status messages that mean damaged files.
_DAMAGE_WORDS = ("Corruption", "corrupt", "checksum", "IO error", "missing files")


def damage_error(
    scheme: str, path: str, exc: BaseException, repair: str
) -> CorruptStoreError | None:
    """A CorruptStoreError for an LSM binding's error that reports damage, else None."""
    text = " ".join(binding_message(exc).split())
    if "No space left" in text or not any(w in text for w in _DAMAGE_WORDS):
        return None
    return corrupt_error(scheme, path, f"{scheme} reports: {text.rstrip('. ')}", repair=repair)


_LOG_BLOCK = 32768  # LevelDB/RocksDB log files are written in blocks of 32 KiB
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_RECYCLABLE = 4  # record types 5..8: the same fragments with a longer header


def _log_cut(path: str) -> str | None:
    """Where a LevelDB/RocksDB log file ends inside a record, or None when it ends cleanly.

    Only the framing is read (headers of 7 bytes, 11 for recyclable records: checksum,
    length, type); the libraries check the checksums themselves. A record of an unknown
    type stops the walk (no verdict).
    """
    size = os.path.getsize(path)
    inside = False
    with open(path, "rb") as f:
        for start in range(0, size, _LOG_BLOCK):
            block = f.read(_LOG_BLOCK)
            pos = 0
            while len(block) - pos >= 7:
                length, kind = struct.unpack_from("<HB", block, pos + 4)
                if kind == 0 and length == 0:
                    break  # zero padding: the rest of the block is unused
                if kind > 2 * _RECYCLABLE:
                    return None
                header = 11 if kind > _RECYCLABLE else 7
                end = pos + header + length
                if end > len(block):
                    if start + len(block) < size or len(block) == _LOG_BLOCK:
                        return None  # a record across a block boundary: not ours to judge
                    return f"its last record needs {end - len(block)} more byte(s)"
                kind = kind - _RECYCLABLE if kind > _RECYCLABLE else kind
                inside = kind in (_FIRST, _MIDDLE)
                pos = end
            if len(block) - pos and len(block) < _LOG_BLOCK and block[pos:].strip(b"\0"):
                return "it ends inside a record header"
    return "it ends inside a record" if inside else None


def _lsm_problem(path: str) -> str | None:
    """What is wrong with an LSM store's CURRENT or MANIFEST, or None."""
    try:
        with open(os.path.join(path, "CURRENT"), "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None  # no store yet (or a lost CURRENT: prepare_directory reports that)
    name = raw.decode("ascii", "replace").strip()
    if not raw.endswith(b"\n") or not name.startswith("MANIFEST-") or "/" in name:
        return f"CURRENT holds {raw[:64]!r}, not the name of a MANIFEST file"
    manifest = os.path.join(path, name)
    try:
        size = os.path.getsize(manifest)
        cut = "it is empty" if not size else _log_cut(manifest)
    except FileNotFoundError:
        return f"CURRENT names {name}, which is missing"
    if not cut:
        return None
    return (
        f"{name} ({size} bytes) is cut short: {cut} (the file was truncated, or the machine "
        "stopped while it was written); opening it would drop the data recorded after the cut"
    )


def check_lsm_files(scheme: str, path: str, repair: str) -> None:
    """Refuse an LSM store whose CURRENT or MANIFEST is cut short (before the binding runs).

    A MANIFEST cut short opens as an older version of the store: the data written since
    reads as absent, and the binding deletes the table files that version does not list.
    A problem is confirmed by a second look a moment later, since a writer in another
    process (beside a RocksDB read-only open) may be appending to the MANIFEST or switching
    to a new one.
    """
    problem = _lsm_problem(path)
    for delay in (0.05, 0.2):
        if problem is None:
            return
        time.sleep(delay)
        problem = _lsm_problem(path)
    if problem is not None:
        raise corrupt_error(scheme, path, problem, repair=repair)


def directory_bytes(path: str) -> int:
    """Total size in bytes of the regular files directly in ``path``.

    A file the database deletes while this runs (a compaction's old tables) counts as gone.
    """
    total = 0
    with os.scandir(path) as it:
        for entry in it:
            try:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
    return total


class SingleWriter:
    """Writes and compare-and-set of a database that one process holds (RocksDB, LevelDB).

    The database's LOCK file keeps other processes out and :func:`claim_path` other store
    objects of this process, so one lock of the store object orders a compare-and-set's read
    and write against every other write. A subclass creates ``_cas_lock`` (an RLock) and
    provides ``_get_many`` and ``_write_batch(ops)``.
    """

    _cas_lock: threading.RLock  # created by the subclass's __init__

    def _get_many(self, keys: list[bytes]) -> list[bytes | None]:
        raise NotImplementedError

    def _write_batch(self, ops: list[WriteOp]) -> None:
        raise NotImplementedError

    def _write(self, ops: list[WriteOp], *, atomic: bool) -> None:
        with self._cas_lock:
            self._write_batch(ops)

    def _compare_and_set(
        self, key: bytes, expected: bytes | None, value: bytes | memoryview | None
    ) -> bool:
        with self._cas_lock:
            if self._get_many([key])[0] != expected:
                return False
            self._write_batch([(key, value)])
            return True


def disk_nearly_full(path: str) -> bool:
    """Whether the file system under ``path`` has almost no room left (< 16 MiB or < 1 %).

    Databases report some writes cut short by a full disk as I/O errors; this tells the two
    apart.
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    free = st.f_bavail * st.f_frsize
    return free < max(16 << 20, st.f_blocks * st.f_frsize // 100)


def write_error(scheme: str, path: str, what: str, exc: BaseException) -> StoreError:
    """The error for a failed write or flush: StoreFullError when the disk is full."""
    text = str(exc)
    if "No space left" in text or disk_nearly_full(path):
        return StoreFullError(
            errno.ENOSPC,
            f"the disk under {scheme} store {path!r} is full ({what}: {text}); free space "
            "and retry",
        )
    return StoreError(f"{scheme} store {path!r}: {what} failed: {text}")


def permission_error(scheme: str, path: str, exc: BaseException) -> StorePermissionError:
    """Wrap a permission failure reported by a binding as a StorePermissionError."""
    return StorePermissionError(
        errno.EACCES,
        f"cannot open the {scheme} store {path!r}: permission denied ({exc}); fix the "
        "directory's permissions or open it with readonly=True",
        path,
    )


# ----------------------------------------------------------------------------- options

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def as_bool(name: str, value: Any) -> bool:
    """Convert an option to bool (bool, 0/1, or true/false/yes/no/on/off strings)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"option {name}={value!r} is not a boolean; use true or false")


def as_size(name: str, value: Any) -> int:
    """Convert an option to bytes (an int or a string such as ``'1GiB'``)."""
    return config.parse_size(value, what=name)


def as_int(name: str, value: Any, minimum: int = 1) -> int:
    """Convert an option to an integer of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"option {name}={value!r} is not an integer")
    try:
        out = int(value)
    except ValueError:
        raise ConfigError(f"option {name}={value!r} is not an integer") from None
    if out < minimum:
        raise ConfigError(f"option {name}={out} is below the minimum {minimum}")
    return out


def take_options(
    scheme: str, options: dict[str, Any], spec: Mapping[str, tuple[Callable[[str, Any], Any], Any]]
) -> dict[str, Any]:
    """Validate backend options against ``spec`` (name -> (converter, default)).

    Unknown names are refused with the list of valid ones; values are converted and
    defaults filled in.
    """
    unknown = sorted(set(options) - set(spec))
    if unknown:
        raise ConfigError(
            f"{scheme} store does not take option(s) {', '.join(unknown)}; valid options: "
            f"{', '.join(sorted(spec))}"
        )
    out = {}
    for name, (convert, default) in spec.items():
        out[name] = convert(name, options[name]) if name in options else default
    return out


# ----------------------------------------------------------------------------- single opener

_OPEN_PATHS: set[str] = set()
_OPEN_LOCK = threading.Lock()


def claim_path(scheme: str, path: str) -> str:
    """Record that this process opened the store at ``path`` for writing.

    LevelDB (and RocksDB) lock their directory with ``fcntl``; a second open in the same
    process fails, and with LevelDB that failed attempt even drops the lock the first open
    holds. Refusing it here, before the binding is called, keeps the lock intact.
    """
    key = os.path.realpath(path)
    with _OPEN_LOCK:
        if key in _OPEN_PATHS:
            raise StoreLockedError(
                errno.EAGAIN,
                f"the {scheme} store {path!r} is already open for writing in this process; "
                f"reuse that store object or close it first ({scheme} allows one writer)",
                path,
            )
        _OPEN_PATHS.add(key)
    return key


def open_in_this_process(path: str) -> bool:
    """Whether a store object of this process holds the store at ``path`` open for writing."""
    with _OPEN_LOCK:
        return os.path.realpath(path) in _OPEN_PATHS


def release_path(key: str) -> None:
    """Forget a path recorded by :func:`claim_path`."""
    with _OPEN_LOCK:
        _OPEN_PATHS.discard(key)


def _close_and_release(close: Callable[[], None], claim: str | None, pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child never closes (and so never flushes) its parent's database
    try:
        close()
    finally:
        if claim is not None:
            release_path(claim)


def close_on_collect(owner: object, close: Callable[[], None], claim: str | None) -> Any:
    """Arrange for ``close()`` and the release of ``claim`` when ``owner`` is collected.

    A store dropped without ``close()`` then frees its database and its claim on the path,
    so the path can be opened again. Returns the finalizer; calling it closes now (once).
    ``close`` must not reference ``owner``. In a child created by ``fork`` it does nothing.
    """
    return weakref.finalize(owner, _close_and_release, close, claim, os.getpid())


def check_same_process(pid: int, url: str) -> None:
    """Refuse to use a store in a child created by ``fork`` from the process that opened it."""
    if os.getpid() != pid:
        raise StoreError(
            f"store {url!r} was opened in process {pid} and cannot be used after fork (two "
            "processes would write one database); open the URL again in the child process"
        )


def locked_error(scheme: str, path: str, exc: BaseException) -> StoreLockedError:
    """Wrap a binding's lock failure as StoreLockedError naming the LOCK file."""
    return StoreLockedError(
        errno.EAGAIN,
        f"the {scheme} store {path!r} is locked by another process "
        f"({os.path.join(path, 'LOCK')} is held: {exc}); {scheme} allows one process at a "
        "time: close the other process's store first, or use lmdb:// or redis:// to share a "
        "store between processes",
        path,
    )


# ----------------------------------------------------------------------------- scans


def chunked_scan(
    read_chunk: Callable[[bytes | None, int], list[tuple[bytes, bytes | None]]],
    start: bytes | None,
    limit: int | None,
    check_open: Callable[[], None],
) -> Iterator[tuple[bytes, bytes | None]]:
    """Yield items read in chunks, resuming after the last key of each chunk.

    ``read_chunk(start, n)`` returns at most ``n`` items with ``key >= start`` in ascending
    order, already cut at the scan's upper bound. No snapshot or transaction is held
    between chunks, so a paused iterator never blocks writers or map growth; each chunk is
    consistent on its own.
    """
    remaining = limit
    pos = start
    step = config.STORE_SCAN_CHUNK
    while True:
        check_open()
        n = step if remaining is None else min(step, remaining)
        chunk = read_chunk(pos, n)
        yield from chunk
        if len(chunk) < n:
            return
        if remaining is not None:
            remaining -= len(chunk)
            if remaining <= 0:
                return
        pos = chunk[-1][0] + b"\x00"  # the smallest key after the last one read
