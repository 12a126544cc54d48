"""How commands go on the wire: large values are sent from their own memory, not copied.

redis-py with hiredis packs a whole command into one new buffer (and first copies every
memoryview into bytes), holding the GIL throughout: a put of many megabytes is two copies
that no other thread can overlap. :class:`LargeValuePacker` hands commands with a value of
``LARGE_VALUE_BYTES`` or more to redis-py's pure-Python packer, which sends such values as
they are (``sendall`` releases the GIL), and every other command to hiredis (faster for
many small values).
"""

from __future__ import annotations

from typing import Any

from redis._parsers.encoders import Encoder
from redis.connection import HiredisRespSerializer, PythonRespSerializer

#: Commands with a value at least this large are packed without copying it.
LARGE_VALUE_BYTES = 64 * 1024


class LargeValuePacker:
    """A redis-py ``command_packer`` that never copies a large value (see the module)."""

    def __init__(self) -> None:
        try:
            self._small: Any = HiredisRespSerializer()
            import hiredis  # noqa: F401
        except ImportError:  # pragma: no cover - hiredis is optional
            self._small = None
        self._large = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
        if self._small is None:  # pragma: no cover
            self._small = self._large

    def pack(self, *args: Any) -> list[Any]:
        """The command's wire bytes, as a list of buffers to send in turn."""
        for a in args:
            if isinstance(a, (bytes, memoryview)) and len(a) >= LARGE_VALUE_BYTES:
                return self._large.pack(*args)
        return self._small.pack(*args)
