"""The size of a PNG, read from its bytes after checking its structure (plot tests)."""

from __future__ import annotations

import struct
import zlib


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature, the CRC and IEND."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    body = data[16:16 + length]
    (crc,) = struct.unpack(">I", data[16 + length:20 + length])
    assert crc == zlib.crc32(kind + body)
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"
    return struct.unpack(">II", body[:8])
