"""Token keys and claims: key-spec forms, algorithms, expiry, the role claim, audience."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import jwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.broker.config import BrokerConfig
from anabranch.errors import AuthenticationError, InvalidArgument
from anabranch.security.authentication import Credentials
from anabranch.security.key_specs import data_spec, read_key_spec
from anabranch.security.providers_token import TokenProvider
from anabranch.security.tokens import (
    create_key_pair,
    create_secret_key,
    create_token,
    parse_duration_s,
)


def verify(provider: TokenProvider, token: str) -> str:
    return asyncio.run(provider.authenticate(Credentials(token.encode()))).role


def config(tmp_path: Path, **fields: object) -> BrokerConfig:
    return BrokerConfig(data_dir=tmp_path, **fields)  # type: ignore[arg-type]


@settings(max_examples=50)
@given(st.binary(max_size=200))
def test_data_spec_round_trip(data: bytes) -> None:
    assert read_key_spec(data_spec(data)) == data


def test_file_spec_and_plain_path(tmp_path: Path) -> None:
    key = tmp_path / "secret.key"
    key.write_bytes(b"\x00\x01raw")
    assert read_key_spec(f"file://{key}") == b"\x00\x01raw"
    assert read_key_spec(str(key)) == b"\x00\x01raw"


@pytest.mark.parametrize("spec", ["data:,abc", "data:;base64,***", "file:///no/such/key"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidArgument):
        read_key_spec(spec)


def test_secret_key_provider_from_config(tmp_path: Path) -> None:
    secret = create_secret_key()
    (tmp_path / "k").write_bytes(secret)
    provider = TokenProvider.from_config(config(tmp_path, token_secret_key=f"file://{tmp_path}/k"))
    assert verify(provider, create_token(secret, "ann")) == "ann"


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
@pytest.mark.parametrize("encoding", ["der", "pem"])
def test_public_key_provider(tmp_path: Path, algorithm: str, encoding: str) -> None:
    private, public = create_key_pair(algorithm)  # type: ignore[arg-type]
    if encoding == "pem":
        body = base64.encodebytes(public).decode()
        public = f"-----BEGIN PUBLIC KEY-----\n{body}-----END PUBLIC KEY-----\n".encode()
    provider = TokenProvider.from_config(config(tmp_path, token_public_key=data_spec(public)))
    assert verify(provider, create_token(private, "svc")) == "svc"
    other_private, _ = create_key_pair(algorithm)  # type: ignore[arg-type]
    with pytest.raises(AuthenticationError, match="invalid token"):
        verify(provider, create_token(other_private, "svc"))


def test_an_hs256_token_is_refused_by_a_public_key_provider(tmp_path: Path) -> None:
    _, public = create_key_pair("RS256")
    provider = TokenProvider.from_config(config(tmp_path, token_public_key=data_spec(public)))
    # The algorithm-confusion attack: an HMAC token "signed" with the public key.
    forged = jwt.encode({"sub": "root"}, public[:32], algorithm="HS256")
    with pytest.raises(AuthenticationError):
        verify(provider, forged)


def test_expiry_claim_and_audience(tmp_path: Path) -> None:
    secret = create_secret_key()
    provider = TokenProvider(secret, ["HS256"], claim="role", audience="pulsar")
    good = create_token(secret, "r", claim="role", extra_claims={"aud": "pulsar"})
    assert verify(provider, good) == "r"
    with pytest.raises(AuthenticationError, match="no 'role' claim"):
        verify(provider, create_token(secret, "r", extra_claims={"aud": "pulsar"}))
    with pytest.raises(AuthenticationError):
        verify(provider, create_token(secret, "r", claim="role", extra_claims={"aud": "x"}))
    expired = create_token(
        secret, "r", claim="role", expires_in_s=-1, extra_claims={"aud": "pulsar"}
    )
    with pytest.raises(AuthenticationError, match="expired"):
        verify(provider, expired)
    live = asyncio.run(
        provider.authenticate(
            Credentials(
                create_token(
                    secret, "r", claim="role", expires_in_s=60, extra_claims={"aud": "pulsar"}
                ).encode()
            )
        )
    )
    assert live.expires_at is not None


def test_config_refuses_both_or_neither_key(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        TokenProvider.from_config(config(tmp_path))
    spec = data_spec(b"k" * 32)
    with pytest.raises(InvalidArgument):
        TokenProvider.from_config(config(tmp_path, token_secret_key=spec, token_public_key=spec))


def test_auth_enabled_needs_a_provider(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="authentication_provider"):
        config(tmp_path, authentication_enabled=True)


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("10m", 600), ("2h", 7200), ("1d", 86400), ("5", 5)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "x", "-1h", "0"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_duration_s(text)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_tokens_are_authentication_errors(data: bytes) -> None:
    provider = TokenProvider(b"k" * 32, ["HS256"])
    with pytest.raises(AuthenticationError):
        asyncio.run(provider.authenticate(Credentials(data)))
