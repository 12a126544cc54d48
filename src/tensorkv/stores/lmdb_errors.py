"""The errors an LMDB store raises for LMDB's own: damage, full reader table, locks."""

from __future__ import annotations

import errno

import lmdb

from tensorkv.errors import StoreError, StoreLockedError
from tensorkv.stores.embedded import corrupt_error, permission_error

#: LMDB errors that mean a damaged file (or, for the reader-slot and transaction ones, a
#: lock file or transaction left unusable by damage met earlier).
_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.InvalidError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
    lmdb.BadRslotError,
    lmdb.BadTxnError,
    lmdb.PageFullError,
    lmdb.CursorFullError,
    lmdb.IncompatibleError,
    lmdb.DiskError,
)


def damage_error(path: str, exc: lmdb.Error) -> Exception:
    """The error to raise for an LMDB error met while opening, reading or writing."""
    text = str(exc)
    if isinstance(exc, _DAMAGE) or "Input/output error" in text:
        return corrupt_error("lmdb", path, f"LMDB reports {type(exc).__name__}: {text}")
    if isinstance(exc, lmdb.ReadersFullError):
        return StoreError(
            f"lmdb store {path!r}: every reader slot is taken ({text}); close other readers "
            "or open the store with a larger max_readers"
        )
    return StoreError(f"lmdb store {path!r}: {type(exc).__name__}: {text}")


def open_error(path: str, exc: lmdb.Error) -> Exception:
    """The error to raise for an LMDB error met while opening an environment."""
    text = str(exc)
    if "Permission denied" in text or "Read-only file system" in text:
        return permission_error("lmdb", path, exc)
    if "Resource temporarily unavailable" in text:
        return StoreLockedError(errno.EAGAIN, f"the lmdb store {path!r} is locked: {exc}", path)
    if isinstance(exc, _DAMAGE):
        return damage_error(path, exc)
    return StoreError(f"cannot open the lmdb store {path!r}: {exc}")
