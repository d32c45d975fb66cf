"""Unique message values: each one names its producer, key and counter.

A workload writes ``p=<producer>;k=<key>;c=<counter>`` so the checker maps every read
back to its write without broker metadata, and per key the counters of one producer give
the order the producer sent them in (Jepsen's "values are unique per key").

Example:
    >>> v = Value("producer-0", "key-3", 17)
    >>> v.encode()
    b'p=producer-0;k=key-3;c=17'
    >>> Value.decode(v.encode()) == v
    True
    >>> Value.decode(b"garbage") is None
    True
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Value:
    """One unique value (see the module docstring)."""

    producer: str
    key: str
    counter: int

    def encode(self) -> bytes:
        return f"p={self.producer};k={self.key};c={self.counter}".encode()

    def text(self) -> str:
        """The encoded form as ``str`` (what the history records)."""
        return self.encode().decode()

    @classmethod
    def decode(cls, data: bytes | str) -> Value | None:
        """The value ``data`` encodes, or None if it is not one of ours."""
        text = data.decode(errors="replace") if isinstance(data, bytes) else data
        parts = dict(part.split("=", 1) for part in text.split(";") if "=" in part)
        try:
            return cls(parts["p"], parts["k"], int(parts["c"]))
        except (KeyError, ValueError):
            return None
