"""Helpers shared by the embedded (file-based) backends: LMDB, RocksDB and LevelDB.

Kept free of any optional dependency so each backend module imports only its own binding.
"""

from __future__ import annotations

import errno
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from tensorkv import config
from tensorkv.errors import (
    ConfigError,
    InvalidURLError,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StorePathError,
    StorePermissionError,
)

if TYPE_CHECKING:
    from tensorkv.stores.registry import StoreURL

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


def prepare_directory(path: str, *, readonly: bool, marker: str, scheme: str) -> None:
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
    """
    if readonly:
        if not os.path.exists(os.path.join(path, marker)):
            what = "does not exist" if not os.path.exists(path) else f"holds no {marker}"
            raise StoreNotFoundError(
                errno.ENOENT,
                f"no {scheme} store at {path!r} ({path!r} {what}); a read-only open needs an "
                f"existing store: open it once with readonly=False to create it",
                path,
            )
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
