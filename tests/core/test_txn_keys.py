"""The transaction-key epoch rules (core/txn_keys.py): the table by example, the
one-live-owner invariant by property over random connect sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch import limits
from anabranch.core.txn_keys import (
    NEW_CLIENT_EPOCH,
    ConnectVerdict,
    Holding,
    fenced_message,
    is_current,
    judge_connect,
    key_id,
    split_key_id,
    validate_key,
    validate_owner,
)
from anabranch.errors import InvalidArgument, NotAllowed

V = ConnectVerdict


@pytest.mark.parametrize(
    ("stored", "request_epoch", "verdict", "epoch"),
    [
        (None, -1, V.CREATE, 0),
        (0, -1, V.BUMP, 1),
        (41, -1, V.BUMP, 42),
        (5, 5, V.RESUME, 5),
        (5, 4, V.FENCED, 4),
        (5, 0, V.FENCED, 0),
        (5, 6, V.FENCED, 6),  # a future epoch: the key was deleted and re-created
        (None, 0, V.FENCED, 0),  # the key was deleted
        (None, -2, V.FENCED, -2),
        (3, -7, V.FENCED, -7),
    ],
)
def test_connect_table(stored: int | None, request_epoch: int, verdict: V, epoch: int) -> None:
    assert judge_connect(stored, request_epoch) == (verdict, epoch)


def test_a_recreated_key_starts_past_the_deleted_epoch() -> None:
    assert judge_connect(None, NEW_CLIENT_EPOCH, floor=8) == (V.CREATE, 8)
    assert judge_connect(None, 7, floor=8)[0] is V.FENCED


def test_is_current_needs_epoch_and_create_revision() -> None:
    held = Holding(2, 100)
    assert is_current(Holding(2, 100), held)
    assert not is_current(Holding(3, 100), held)
    assert not is_current(Holding(2, 200), held)  # deleted and re-created up to epoch 2
    assert not is_current(None, held)


@pytest.mark.parametrize(
    "key", ["", "a&b", "&", "x" * (limits.TXN_KEY_BYTES_MAX + 1), "é" * 101, "a\nb", "\x7f"]
)
def test_bad_keys_are_refused(key: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_key(key)


@pytest.mark.parametrize("key", ["etl-7", "a/b c", "x" * limits.TXN_KEY_BYTES_MAX, "ключ"])
def test_good_keys(key: str) -> None:
    assert validate_key(key) == key


def test_owner_rules() -> None:
    assert validate_owner("") == ""
    assert validate_owner("alice") == "alice"
    with pytest.raises(NotAllowed):
        validate_owner("a&b")
    with pytest.raises(NotAllowed):
        validate_owner("r" * (limits.TXN_KEY_OWNER_BYTES_MAX + 1))


@given(owner=st.text().filter(lambda s: "&" not in s), key=st.text(min_size=1))
def test_key_id_round_trips(owner: str, key: str) -> None:
    assert split_key_id(key_id(owner, key)) == (owner, key)


def test_fenced_messages_say_fenced_and_transaction() -> None:
    for text in (fenced_message("k", 0, 1), fenced_message("k", 3, None)):
        assert "fenced" in text and "transaction" in text


# --- the invariant: one live owner, epochs only grow, a fenced client stays fenced ------------

# An action: ("new", _) a new client connects with -1; ("re", i) client i reconnects with
# its last epoch; ("delete", _) the admin deletes the key.
actions = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.just(0)),
        st.tuples(st.just("re"), st.integers(0, 20)),
        st.tuples(st.just("delete"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps=actions)
def test_one_live_owner(steps: list[tuple[str, int]]) -> None:
    stored: int | None = None
    floor = 0  # what a deleted record leaves behind (its epoch + 1)
    high = NEW_CLIENT_EPOCH  # the highest epoch ever stored
    clients: list[int] = []  # each client's last epoch
    fenced: set[int] = set()  # clients that were refused once
    owner: int | None = None  # the client that made the stored epoch
    for kind, index in steps:
        if kind == "delete":
            if stored is not None:
                floor = stored + 1
            stored, owner = None, None
            continue
        if kind == "new":
            verdict, epoch = judge_connect(stored, NEW_CLIENT_EPOCH, floor=floor)
            assert verdict in (V.CREATE, V.BUMP)
            clients.append(epoch)
            owner = len(clients) - 1
            assert epoch > high  # never handed out twice
            stored = epoch
            high = max(high, epoch)
            continue
        if not clients:
            continue
        client = index % len(clients)
        verdict, epoch = judge_connect(stored, clients[client])
        if verdict is V.RESUME:
            # Only the client that made the stored epoch resumes it.
            assert client == owner
            assert client not in fenced
            assert epoch == stored
        else:
            assert verdict is V.FENCED
            assert client != owner or stored is None
            fenced.add(client)
    # At most one client holds the stored epoch.
    holders = [i for i, e in enumerate(clients) if stored is not None and e == stored]
    assert len(holders) <= 1
