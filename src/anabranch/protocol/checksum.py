"""CRC32-C (Castagnoli) of payload frames, via google-crc32c's C implementation.

The pure-Python fallback of google-crc32c is ~1000x slower, which would make every SEND
and MESSAGE CPU-bound; importing this module fails loudly instead of silently degrading.

Example:
    >>> crc32c(b"123456789") == 0xE3069283
    True
"""

from __future__ import annotations

import google_crc32c

if google_crc32c.implementation != "c":  # pragma: no cover - depends on the install
    raise ImportError(
        "google-crc32c is using its pure-Python fallback "
        f"(implementation={google_crc32c.implementation!r}); install a wheel with the "
        "C extension for this platform"
    )


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC32-C of ``data`` as an unsigned 32-bit integer.

    Example:
        >>> hex(crc32c(b""))
        '0x0'
    """
    return int(google_crc32c.value(bytes(data) if isinstance(data, memoryview) else data))
