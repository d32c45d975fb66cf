"""The epoch rules of transaction keys (pip-transaction-key-fencing), without I/O.

A transaction key is ``(owner, key)``: the owner is the connection's authenticated role
("" while auth is off), the key the client's ``transaction_key``. The coordinator keeps
one record per key with an **epoch**; :mod:`anabranch.transactions.keys` reads, judges
with these functions and writes.

Connect (TC_CLIENT_CONNECT carrying the key and the client's last epoch):

=====================================  =============  ===================================
stored record / request epoch          verdict        what the coordinator does
=====================================  =============  ===================================
none / -1 (a new client)               CREATE         create the record at epoch 0 (or
                                                      past a deleted record's last epoch)
epoch e / -1                           BUMP           CAS to e + 1, abort e's open txn,
                                                      close the connections holding e
epoch e / e (a reconnect)              RESUME         nothing: keep e, keep its txn
epoch e / below e                      FENCED         NotAllowed ("fenced")
epoch e / above e, none / >= 0         FENCED         the record was deleted (and maybe
                                                      re-created): the delete fenced the
                                                      holder
=====================================  =============  ===================================

A command (NEW_TXN, ADD_*, END_TXN) of a connection that holds epoch ``e`` of a record
created at store revision ``c`` is current only while the stored record still has both
(:func:`is_current`): a re-created record has a new create revision even when its epoch
is back to ``e``. A deleted record leaves its last epoch behind (``floor``), and a
re-created one starts above it, so an epoch is never handed out twice for one key: a
holder fenced by a delete cannot resume a later incarnation of the key.

Example:
    >>> judge_connect(None, NEW_CLIENT_EPOCH)
    (<ConnectVerdict.CREATE: 'create'>, 0)
    >>> judge_connect(3, NEW_CLIENT_EPOCH)
    (<ConnectVerdict.BUMP: 'bump'>, 4)
    >>> judge_connect(3, 3)
    (<ConnectVerdict.RESUME: 'resume'>, 3)
    >>> judge_connect(3, 2)[0].name
    'FENCED'
    >>> key_id("", "etl-7"), split_key_id("alice&etl-7")
    ('&etl-7', ('alice', 'etl-7'))
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from anabranch import limits
from anabranch.errors import InvalidArgument, NotAllowed

NEW_CLIENT_EPOCH = -1
"""The epoch a client sends before it ever got one (the PIP's initial -1)."""

SEPARATOR = "&"
"""Between owner and key in a key id: the reason keys must not contain it."""


class ConnectVerdict(enum.Enum):
    CREATE = "create"
    BUMP = "bump"
    RESUME = "resume"
    FENCED = "fenced"


@dataclass(frozen=True, slots=True)
class Holding:
    """What a connection holds of a key: its epoch, and the create revision of the record
    that epoch belongs to (tells a re-created record apart)."""

    epoch: int
    create_revision: int


def validate_key(key: str) -> str:
    """``key`` if a client may claim it, else InvalidArgument (nothing is written).

    Example:
        >>> validate_key("etl-7")
        'etl-7'
        >>> validate_key("a&b")
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: transaction key 'a&b' contains '&'
    """
    if not key:
        raise InvalidArgument("transaction key is empty")
    if SEPARATOR in key:
        raise InvalidArgument(f"transaction key {key[:64]!r} contains {SEPARATOR!r}")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > limits.TXN_KEY_BYTES_MAX:
        raise InvalidArgument(
            f"transaction key is {size} bytes, over the limit of {limits.TXN_KEY_BYTES_MAX}"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise InvalidArgument(f"transaction key {key[:64]!r} contains a control character")
    return key


def validate_owner(owner: str) -> str:
    """``owner`` (a role, "" without auth) if it fits a record, else NotAllowed."""
    if SEPARATOR in owner or len(owner.encode()) > limits.TXN_KEY_OWNER_BYTES_MAX:
        raise NotAllowed(
            f"role {owner[:64]!r} cannot hold a transaction key (contains {SEPARATOR!r} or is "
            f"over {limits.TXN_KEY_OWNER_BYTES_MAX} bytes)"
        )
    return owner


def key_id(owner: str, key: str) -> str:
    """``<owner>&<key>``: the PIP's mapping key (unambiguous: neither part holds ``&``)."""
    return f"{owner}{SEPARATOR}{key}"


def split_key_id(text: str) -> tuple[str, str]:
    """``(owner, key)`` of a key id; InvalidArgument without the separator."""
    owner, sep, key = text.partition(SEPARATOR)
    if not sep or not key:
        raise InvalidArgument(f"not a transaction key id: {text[:64]!r}")
    return owner, key


def judge_connect(
    stored_epoch: int | None, request_epoch: int, *, floor: int = 0
) -> tuple[ConnectVerdict, int]:
    """The verdict on a connect and the epoch the connection holds after it (see the
    module table). ``stored_epoch`` None: no record; ``floor``: the epoch a new record
    starts at (0, or one past the last epoch of a deleted record of the key)."""
    if request_epoch < NEW_CLIENT_EPOCH:
        return ConnectVerdict.FENCED, request_epoch
    if request_epoch == NEW_CLIENT_EPOCH:
        if stored_epoch is None:
            return ConnectVerdict.CREATE, max(floor, 0)
        return ConnectVerdict.BUMP, stored_epoch + 1
    if stored_epoch is not None and request_epoch == stored_epoch:
        return ConnectVerdict.RESUME, stored_epoch
    return ConnectVerdict.FENCED, request_epoch


def is_current(stored: Holding | None, held: Holding) -> bool:
    """Whether a connection holding ``held`` may still act for the key whose record is
    ``stored`` (None: deleted)."""
    return stored is not None and stored == held


def fenced_message(key: str, held_epoch: int, stored_epoch: int | None) -> str:
    """The NotAllowed text of a fenced connection (it names "transaction" and "fenced",
    so clients raise ExpiredTransactionError).

    Example:
        >>> fenced_message("etl-7", 0, 1)
        "transaction key 'etl-7' epoch 0 is fenced: epoch 1 holds it now"
    """
    if stored_epoch is None:
        return f"transaction key {key!r} epoch {held_epoch} is fenced: the key was deleted"
    return (
        f"transaction key {key!r} epoch {held_epoch} is fenced: epoch {stored_epoch} holds it now"
    )


__all__ = [
    "NEW_CLIENT_EPOCH",
    "SEPARATOR",
    "ConnectVerdict",
    "Holding",
    "fenced_message",
    "is_current",
    "judge_connect",
    "key_id",
    "split_key_id",
    "validate_key",
    "validate_owner",
]
