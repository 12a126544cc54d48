"""Keys of the repository's metadata (the data keys live in :mod:`.tensors`)."""

from __future__ import annotations

import json
from typing import Any

from tensorkv.errors import CorruptRecordError

#: On every provider: the provider's id (rendezvous placement hashes it).
PROVIDER_KEY = b"repo/provider"
#: Manifests (metadata provider): ``repo/m/<model id>`` -> JSON.
MANIFESTS = b"repo/m/"
#: Put and delete intents (metadata provider): ``repo/p/<model id>`` -> JSON.
INTENTS = b"repo/p/"


def manifest_key(mid: str) -> bytes:
    """Key of a model's manifest."""
    return MANIFESTS + mid.encode()


def intent_key(mid: str) -> bytes:
    """Key of a put's or delete's intent record (the tensors it is touching)."""
    return INTENTS + mid.encode()


def load_json(key: bytes, raw: bytes | memoryview) -> Any:
    """Parse a JSON record, or raise :class:`CorruptRecordError` naming its key."""
    try:
        return json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptRecordError(
            f"record {key.decode(errors='replace')} is not valid JSON ({exc}); the repository "
            "is damaged there: repo.check() lists the damage"
        ) from None
