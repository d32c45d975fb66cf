"""Payload compression with the codecs and byte formats Pulsar clients use.

Pulsar compresses the whole payload (a single message or a whole batch) as one block and
records the codec and ``uncompressed_size`` in MessageMetadata:

- LZ4: a raw LZ4 *block* (no frame header, no size prefix).
- ZLIB: zlib format (2-byte header + deflate + adler32), as ``zlib.compress`` makes.
- ZSTD: a standard zstd frame.
- SNAPPY: raw snappy (a varint length, then the block; not the framing format).

Decompression never trusts the input: the declared size is checked against the caller's
bound before anything is allocated, and the decoder writes into a buffer of exactly that
size, so a decompression bomb or a lying size is an ``InvalidMessage``, never a MemoryError.

Example:
    >>> data = b"hello " * 100
    >>> packed = compress(CompressionType.ZSTD, data)
    >>> decompress(CompressionType.ZSTD, packed, len(data), max_size=1024) == data
    True
"""

from __future__ import annotations

import zlib
from enum import IntEnum

import cramjam

from anabranch.errors import InvalidMessage


class CompressionType(IntEnum):
    """Values of the ``CompressionType`` protobuf enum."""

    NONE = 0
    LZ4 = 1
    ZLIB = 2
    ZSTD = 3
    SNAPPY = 4


def compress(codec: int, data: bytes) -> bytes:
    """Compress ``data`` the way Pulsar clients do for ``codec``.

    Example:
        >>> compress(CompressionType.LZ4, b"hello")
        b'Phello'
    """
    if codec == CompressionType.NONE:
        return data
    if codec == CompressionType.LZ4:
        return bytes(cramjam.lz4.compress_block(data, store_size=False))
    if codec == CompressionType.ZLIB:
        return zlib.compress(data)
    if codec == CompressionType.ZSTD:
        return bytes(cramjam.zstd.compress(data))
    if codec == CompressionType.SNAPPY:
        return bytes(cramjam.snappy.compress_raw(data))
    raise InvalidMessage(f"unknown compression type {codec}")


def decompress(codec: int, data: bytes, uncompressed_size: int, max_size: int) -> bytes:
    """Decompress ``data``, which must expand to exactly ``uncompressed_size`` bytes.

    Raises ``InvalidMessage`` if the size is negative or over ``max_size``, the input is
    corrupt, or it expands to any other size.

    Example:
        >>> decompress(CompressionType.SNAPPY, b"\\x05\\x10hello", 5, max_size=10)
        b'hello'
    """
    if codec == CompressionType.NONE:
        if len(data) > max_size:
            raise InvalidMessage(f"payload of {len(data)} bytes is over {max_size}")
        return data
    if uncompressed_size < 0 or uncompressed_size > max_size:
        raise InvalidMessage(
            f"declared uncompressed size {uncompressed_size} is outside [0, {max_size}]"
        )
    try:
        out = _decompress_exact(codec, data, uncompressed_size)
    except InvalidMessage:
        raise
    except Exception as err:  # cramjam and zlib raise their own error types
        raise InvalidMessage(f"{_name(codec)} decompression failed: {err}") from err
    return out


def _decompress_exact(codec: int, data: bytes, size: int) -> bytes:
    if codec == CompressionType.ZLIB:
        inflater = zlib.decompressobj()
        # max_length=size+1 stops a bomb after one byte too many.
        out = inflater.decompress(data, size + 1)
        if len(out) != size or not inflater.eof:
            raise InvalidMessage(f"zlib data does not expand to the declared {size} bytes")
        return out
    if codec == CompressionType.SNAPPY:
        declared = int(cramjam.snappy.decompress_raw_len(data))
        if declared != size:
            raise InvalidMessage(f"snappy header says {declared} bytes, metadata says {size}")
    if codec not in (CompressionType.LZ4, CompressionType.ZSTD, CompressionType.SNAPPY):
        raise InvalidMessage(f"unknown compression type {codec}")
    # One spare byte: a stream that fills it expanded past the declared size.
    buf = bytearray(size + 1)
    if codec == CompressionType.LZ4:
        written = int(cramjam.lz4.decompress_block_into(data, buf))
    elif codec == CompressionType.ZSTD:
        written = int(cramjam.zstd.decompress_into(data, buf))
    else:
        written = int(cramjam.snappy.decompress_raw_into(data, buf))
    if written != size:
        raise InvalidMessage(f"{_name(codec)} data expands to {written} bytes, not {size}")
    del buf[size:]
    return bytes(buf)


def _name(codec: int) -> str:
    try:
        return CompressionType(codec).name
    except ValueError:
        return str(codec)
