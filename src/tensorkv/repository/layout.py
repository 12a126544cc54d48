"""Keys of the repository's metadata (the data keys live in :mod:`.tensors`)."""

from __future__ import annotations

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
