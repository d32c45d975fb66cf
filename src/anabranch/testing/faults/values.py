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
        parts = _fields(data)
        try:
            return cls(parts["p"], parts["k"], int(parts["c"]))
        except (KeyError, ValueError):
            return None


@dataclass(frozen=True, order=True)
class TxnValue:
    """One unique value written in a transaction: ``x=<txn>;id=<txn id>;i=<index>``.

    ``txn`` is the workload's name for the transaction (unique in a run), ``txn_id`` the
    broker's id (``most:least``) and ``index`` its place among the transaction's writes.
    It has no ``p=`` part, so :meth:`Value.decode` rejects it and the per-producer
    order check leaves transactional values alone.

    Example:
        >>> v = TxnValue("txn-0.3", "5:17", 1)
        >>> v.text()
        'x=txn-0.3;id=5:17;i=1'
        >>> TxnValue.decode(v.text()) == v, Value.decode(v.text())
        (True, None)
    """

    txn: str
    txn_id: str
    index: int

    def text(self) -> str:
        return f"x={self.txn};id={self.txn_id};i={self.index}"

    @classmethod
    def decode(cls, data: bytes | str) -> TxnValue | None:
        """The transactional value ``data`` encodes, or None if it is not one."""
        parts = _fields(data)
        try:
            return cls(parts["x"], parts["id"], int(parts["i"]))
        except (KeyError, ValueError):
            return None


def _fields(data: bytes | str) -> dict[str, str]:
    """The ``name=value`` parts of an encoded value (``;``-separated)."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    return dict(part.split("=", 1) for part in text.split(";") if "=" in part)
