"""Token authentication (Pulsar's ``AuthenticationProviderToken``): a JWT signed with the
broker's HS256 secret key or by the private half of its RS256/ES256 public key; the role is
the ``token_auth_claim`` claim (``sub``), ``exp`` is enforced, ``aud`` when configured.

Example:
    >>> import asyncio
    >>> from anabranch.security.tokens import create_token
    >>> provider = TokenProvider(b"k" * 32, ["HS256"])
    >>> asyncio.run(provider.authenticate(Credentials(create_token(b"k" * 32, "ann").encode())))
    Authenticated(role='ann', expires_at=None)
    >>> asyncio.run(provider.authenticate(Credentials(b"not-a-jwt")))
    Traceback (most recent call last):
    ...
    anabranch.errors.AuthenticationError: authentication failed: invalid token
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jwt

from anabranch.errors import AuthenticationError, InvalidArgument
from anabranch.security.authentication import Authenticated, Credentials
from anabranch.security.key_specs import read_key_spec
from anabranch.security.tokens import algorithm_of, load_public_key

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig

TOKEN_BYTES_MAX = 16 * 1024
"""Longest token looked at: JWTs are a few hundred bytes; a larger blob is refused before
any base64 or JSON work."""


class TokenProvider:
    """Verifies JWTs with one key (see the module docstring)."""

    method = "token"

    def __init__(
        self,
        key: Any,
        algorithms: list[str],
        *,
        claim: str = "sub",
        audience: str | None = None,
    ) -> None:
        self._key = key
        self._algorithms = algorithms
        self._claim = claim
        self._audience = audience

    @classmethod
    def from_config(cls, config: BrokerConfig) -> TokenProvider:
        """From ``token_secret_key`` (HS256) or ``token_public_key`` (RS256/ES256)."""
        if config.token_secret_key and config.token_public_key:
            raise InvalidArgument("set token_secret_key or token_public_key, not both")
        if config.token_secret_key:
            key: Any = read_key_spec(config.token_secret_key)
            algorithms = ["HS256"]
        elif config.token_public_key:
            key = load_public_key(read_key_spec(config.token_public_key))
            algorithms = [algorithm_of(key)]
        else:
            raise InvalidArgument("the token provider needs token_secret_key or token_public_key")
        return cls(key, algorithms, claim=config.token_auth_claim, audience=config.token_audience)

    async def authenticate(self, credentials: Credentials) -> Authenticated:
        """Verification is microseconds (HS256) to ~50 µs (RS256): done on the loop."""
        return self.verify(credentials.data)

    def verify(self, data: bytes) -> Authenticated:
        """The role of token ``data`` (see the module docstring)."""
        if not data:
            raise AuthenticationError("no token")
        if len(data) > TOKEN_BYTES_MAX:
            raise AuthenticationError("token too long")
        token = data.decode("utf-8", "replace").strip()
        token = token.removeprefix("Bearer ").strip()
        try:
            claims = jwt.decode(
                token,
                self._key,
                algorithms=self._algorithms,
                audience=self._audience,
                options={"verify_aud": self._audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("token expired") from None
        except jwt.InvalidTokenError:
            raise AuthenticationError("invalid token") from None
        role = claims.get(self._claim)
        if not isinstance(role, str) or not role:
            raise AuthenticationError(f"token has no {self._claim!r} claim")
        exp = claims.get("exp")
        return Authenticated(role, float(exp) if isinstance(exp, (int, float)) else None)
