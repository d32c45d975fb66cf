"""Pulsar's forms for a key or file given in configuration: ``file:///abs/path``,
``data:;base64,<base64>`` (also ``data:application/octet-stream;base64,...``), or a plain
path. Read once at start-up.

Example:
    >>> read_key_spec("data:;base64,c2VjcmV0")
    b'secret'
    >>> read_key_spec("")
    Traceback (most recent call last):
    ...
    anabranch.errors.InvalidArgument: empty key setting
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from anabranch.errors import InvalidArgument


def read_key_spec(spec: str) -> bytes:
    """The bytes ``spec`` names (see the module docstring); InvalidArgument if it cannot be
    read (the message names the setting's form, not the file's contents)."""
    spec = spec.strip()
    if not spec:
        raise InvalidArgument("empty key setting")
    if spec.startswith("data:"):
        _, sep, encoded = spec.partition(",")
        if not sep or ";base64" not in spec[: spec.index(",")]:
            raise InvalidArgument("a data: key must be data:;base64,<base64>")
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as err:
            raise InvalidArgument("a data: key is not valid base64") from err
    path = Path(spec.removeprefix("file://"))
    try:
        return path.read_bytes()
    except OSError as err:
        raise InvalidArgument(f"cannot read key file {path}: {err.strerror}") from err


def data_spec(data: bytes) -> str:
    """``data:;base64,...`` for ``data`` (the inverse of :func:`read_key_spec`).

    Example:
        >>> data_spec(b"secret")
        'data:;base64,c2VjcmV0'
    """
    return "data:;base64," + base64.b64encode(data).decode("ascii")
