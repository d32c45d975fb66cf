"""Basic authentication (htpasswd) with the official client and ours, and the htpasswd
hashes themselves (bcrypt, Apache ``$apr1$`` MD5, ``{SHA}``)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import bcrypt
import pulsar
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch import AuthenticationBasic
from anabranch.admin.client import AdminClient, AdminHttpError
from anabranch.aio import Client
from anabranch.client.errors import AuthenticationFailed
from anabranch.errors import InvalidArgument
from anabranch.security.htpasswd import apr1_md5, check_password, parse_htpasswd
from anabranch.testing.broker import InProcessBroker
from tests.security.official import refusal, round_trip

TOPIC = "persistent://public/default/basic"


def bcrypt_hash(password: str) -> str:
    # Apache writes $2y$; the low cost keeps the test fast (the cost is in the hash).
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    return "$2y$" + hashed[4:]


def sha_hash(password: str) -> str:
    return "{SHA}" + base64.b64encode(hashlib.sha1(password.encode()).digest()).decode()


@pytest.fixture
async def basic_broker(tmp_path: Path) -> AsyncIterator[InProcessBroker]:
    htpasswd = tmp_path / "htpasswd"
    htpasswd.write_text(
        "# users\n"
        f"ann:{bcrypt_hash('ann-pw')}\n"
        f"ben:{apr1_md5('ben-pw', 'saltsalt')}\n"
        f"cat:{sha_hash('cat-pw')}\n"
    )
    async with InProcessBroker(
        tmp_path / "data",
        authentication_enabled=True,
        authentication_providers=["basic"],
        basic_auth_conf=f"file://{htpasswd}",
    ) as broker:
        yield broker


@pytest.mark.parametrize("user", ["ann", "ben", "cat"])
async def test_official_client_round_trip(basic_broker: InProcessBroker, user: str) -> None:
    got = await asyncio.to_thread(
        round_trip,
        basic_broker.service_url,
        f"{TOPIC}-{user}",
        authentication=pulsar.AuthenticationBasic(user, f"{user}-pw"),
    )
    assert got == [f"m-{i}".encode() for i in range(5)]


@pytest.mark.parametrize(("user", "password"), [("ann", "wrong"), ("nobody", "x")])
async def test_official_client_wrong_password(
    basic_broker: InProcessBroker, user: str, password: str
) -> None:
    name = await asyncio.to_thread(
        refusal,
        basic_broker.service_url,
        TOPIC,
        authentication=pulsar.AuthenticationBasic(user, password),
    )
    assert name == "AuthenticationError"


async def test_our_client(basic_broker: InProcessBroker) -> None:
    async with Client(
        basic_broker.service_url, auth=AuthenticationBasic("ben", "ben-pw")
    ) as client:
        producer = await client.create_producer(TOPIC)
        await producer.send(b"x")
        assert basic_broker.node is not None
        assert "ben" in [s.role for s in basic_broker.node.server.sessions]
    async with Client(basic_broker.service_url, auth=AuthenticationBasic("ben", "no")) as bad:
        with pytest.raises(AuthenticationFailed):
            await bad.create_producer(TOPIC)


async def test_http_basic(basic_broker: InProcessBroker) -> None:
    assert basic_broker.http_url is not None
    good = AuthenticationBasic("ann", "ann-pw")
    async with AdminClient(basic_broker.http_url, auth=good) as admin:
        assert "public" in await admin.list_tenants()
        assert "public" in await admin.list_tenants()  # the second check is remembered
    bad = AuthenticationBasic("ann", "nope")
    async with AdminClient(basic_broker.http_url, auth=bad) as admin:
        with pytest.raises(AdminHttpError) as caught:
            await admin.list_tenants()
        assert caught.value.status == 401


# --- htpasswd ---------------------------------------------------------------------------------


def test_apr1_matches_openssl() -> None:
    out = subprocess.run(
        ["openssl", "passwd", "-apr1", "-salt", "abcdefgh", "s3cret pass"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert apr1_md5("s3cret pass", "abcdefgh") == out
    assert check_password(out, "s3cret pass")
    assert not check_password(out, "s3cret pas")


@settings(max_examples=40, deadline=None)
@given(
    password=st.text(min_size=0, max_size=40),
    salt=st.text(alphabet="./0123456789abcdefXYZ", min_size=1, max_size=8),
)
def test_apr1_round_trip(password: str, salt: str) -> None:
    hashed = apr1_md5(password, salt)
    assert hashed.startswith(f"$apr1${salt}$")
    assert check_password(hashed, password)
    assert not check_password(hashed, password + "x")


@settings(max_examples=40, deadline=None)
@given(password=st.text(max_size=40))
def test_sha_round_trip(password: str) -> None:
    assert check_password(sha_hash(password), password)
    assert not check_password(sha_hash(password), password + "!")


def test_bcrypt_2y_2a_2b() -> None:
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()
    for prefix in ("$2y$", "$2a$", "$2b$"):
        assert check_password(prefix + hashed[4:], "pw")
        assert not check_password(prefix + hashed[4:], "pW")


@pytest.mark.parametrize(
    "text",
    ["justauser", "user:", ":hash", "user:plaintext", "user:abJN5s7P8cQwY"],  # last: DES crypt
)
def test_bad_lines_are_refused_with_their_number(text: str) -> None:
    with pytest.raises(InvalidArgument, match="line 2") as caught:
        parse_htpasswd("# ok\n" + text + "\n")
    assert "plaintext" not in str(caught.value)  # the line's content is not echoed


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_parser_never_crashes(text: str) -> None:
    try:
        users = parse_htpasswd(text)
    except InvalidArgument:
        return
    assert all(":" not in user for user in users)
