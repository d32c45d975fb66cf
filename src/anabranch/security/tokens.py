"""Keys and JWTs for token authentication, as ``pulsar tokens`` makes them.

A secret key is 32 random bytes (HS256). A key pair is an RSA-2048 (RS256) or P-256
(ES256) private key in PKCS#8 DER and its public key in SubjectPublicKeyInfo DER, the
files ``pulsar tokens create-key-pair`` writes; PEM is read too. A token's role is its
``sub`` claim (or another claim the broker names), ``exp`` its expiry.

Example:
    >>> secret = create_secret_key()
    >>> token = create_token(secret, "alice")
    >>> import jwt
    >>> jwt.decode(token, secret, algorithms=["HS256"])["sub"]
    'alice'
    >>> private, public = create_key_pair("ES256")
    >>> claims = jwt.decode(create_token(private, "bob"), load_public_key(public),
    ...                     algorithms=["ES256"])
    >>> claims["sub"]
    'bob'
"""

from __future__ import annotations

import os
import time
from typing import Literal

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    PrivateKeyTypes,
    PublicKeyTypes,
)

from anabranch.errors import InvalidArgument

SECRET_KEY_BYTES = 32
"""HS256 key length: the hash's block-size-independent minimum RFC 7518 asks for."""

KeyAlgorithm = Literal["RS256", "ES256"]


def create_secret_key() -> bytes:
    """A fresh HS256 secret key."""
    return os.urandom(SECRET_KEY_BYTES)


def create_key_pair(algorithm: KeyAlgorithm = "RS256") -> tuple[bytes, bytes]:
    """``(private PKCS#8 DER, public SPKI DER)`` for ``algorithm``."""
    private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
    if algorithm == "RS256":
        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    elif algorithm == "ES256":
        private = ec.generate_private_key(ec.SECP256R1())
    else:
        raise InvalidArgument(f"unsupported key algorithm {algorithm!r} (RS256 or ES256)")
    private_der = private.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_der = private.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return private_der, public_der


def load_public_key(data: bytes) -> PublicKeyTypes:
    """A public key from DER or PEM bytes."""
    try:
        if data.lstrip().startswith(b"-----"):
            return serialization.load_pem_public_key(data)
        return serialization.load_der_public_key(data)
    except ValueError as err:
        raise InvalidArgument("not a DER or PEM public key") from err


def load_private_key(data: bytes) -> PrivateKeyTypes:
    """A private key from DER or PEM bytes (unencrypted)."""
    try:
        if data.lstrip().startswith(b"-----"):
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError) as err:
        raise InvalidArgument("not an unencrypted DER or PEM private key") from err


def algorithm_of(key: PrivateKeyTypes | PublicKeyTypes) -> KeyAlgorithm:
    """RS256 for an RSA key, ES256 for a P-256 key.

    Example:
        >>> algorithm_of(load_private_key(create_key_pair("RS256")[0]))
        'RS256'
    """
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        return "RS256"
    ec_types = (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)
    if isinstance(key, ec_types) and isinstance(key.curve, ec.SECP256R1):
        return "ES256"
    raise InvalidArgument("token keys must be RSA (RS256) or EC P-256 (ES256)")


def create_token(
    key: bytes,
    subject: str,
    *,
    expires_in_s: float | None = None,
    claim: str = "sub",
    now: float | None = None,
    extra_claims: dict[str, object] | None = None,
) -> str:
    """A JWT naming ``subject`` in ``claim``, signed with ``key``: a secret key (HS256) or
    a private key in DER/PEM (RS256 or ES256 by its type). ``expires_in_s`` sets ``exp``.

    Example:
        >>> t = create_token(b"k" * 32, "svc", expires_in_s=60, now=0)
        >>> jwt.decode(t, b"k" * 32, algorithms=["HS256"], options={"verify_exp": False})
        {'sub': 'svc', 'exp': 60}
    """
    claims: dict[str, object] = {claim: subject}
    if expires_in_s is not None:
        claims["exp"] = int((time.time() if now is None else now) + expires_in_s)
    if extra_claims:
        claims.update(extra_claims)
    if _looks_like_private_key(key):
        private = load_private_key(key)
        return jwt.encode(claims, private, algorithm=algorithm_of(private))  # type: ignore[arg-type]
    return jwt.encode(claims, key, algorithm="HS256")


def _looks_like_private_key(key: bytes) -> bool:
    if key.lstrip().startswith(b"-----BEGIN"):
        return True
    # DER: an ASN.1 SEQUENCE long enough to be a key; a 32-byte secret is not tried.
    if len(key) > 64 and key[:1] == b"\x30":
        try:
            load_private_key(key)
        except InvalidArgument:
            return False
        return True
    return False


def parse_duration_s(text: str) -> float:
    """Pulsar's expiry forms: ``30s``, ``10m``, ``2h``, ``7d``, ``1w``, ``1y`` (a plain
    number is seconds).

    Example:
        >>> parse_duration_s("2h"), parse_duration_s("90")
        (7200.0, 90.0)
    """
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}
    text = text.strip().lower()
    factor = units.get(text[-1:])
    number = text[:-1] if factor is not None else text
    try:
        value = float(number) * (factor or 1)
    except ValueError as err:
        raise InvalidArgument(f"bad duration {text!r} (e.g. 30s, 10m, 2h, 7d, 1y)") from err
    if value <= 0:
        raise InvalidArgument(f"duration {text!r} must be positive")
    return value
