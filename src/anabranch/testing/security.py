"""Authentication set-ups for tests: keys, tokens and broker settings in one object.

:class:`TokenAuth` makes an HS256 secret (or an RS256/ES256 key pair), mints tokens for
any role and gives the BrokerConfig fields that turn token authentication on; pass it as
``InProcessBroker(..., security=auth)`` (or merge :meth:`TokenAuth.broker_config` into the
config yourself). Certificates for TLS tests are made by
:mod:`anabranch.testing.certificates`.

Example:
    >>> auth = TokenAuth()
    >>> cfg = auth.broker_config()
    >>> (cfg["authentication_enabled"], cfg["authentication_providers"])
    (True, ['token'])
    >>> import jwt
    >>> jwt.decode(auth.token("alice"), auth.secret, algorithms=["HS256"])["sub"]
    'alice'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from anabranch.security.key_specs import data_spec
from anabranch.security.tokens import create_key_pair, create_secret_key, create_token


class BrokerSecurity(Protocol):
    """Something that contributes BrokerConfig fields (auth, TLS) to a test broker."""

    def broker_config(self) -> dict[str, Any]:
        """BrokerConfig field values to merge."""
        ...


@dataclass
class TokenAuth:
    """Token authentication for a test broker (see the module docstring).

    ``algorithm`` HS256 (a secret key) or RS256/ES256 (a key pair; the broker gets only
    the public key). ``superusers`` become ``superuser_roles``; ``broker_role`` is the role
    of the token the broker itself presents to other brokers (cluster calls).
    """

    algorithm: Literal["HS256", "RS256", "ES256"] = "HS256"
    superusers: list[str] = field(default_factory=lambda: ["admin"])
    broker_role: str = "broker"
    extra: dict[str, Any] = field(default_factory=dict)
    """More BrokerConfig fields (e.g. ``anonymous_user_role``)."""

    def __post_init__(self) -> None:
        if self.algorithm == "HS256":
            self.secret = create_secret_key()
            self.signing_key = self.secret
            self.public_key = b""
        else:
            self.signing_key, self.public_key = create_key_pair(self.algorithm)
            self.secret = b""

    def token(self, role: str, *, expires_in_s: float | None = None) -> str:
        """A valid token for ``role``."""
        return create_token(self.signing_key, role, expires_in_s=expires_in_s)

    @property
    def superuser_token(self) -> str:
        """A token of the first superuser role."""
        return self.token(self.superusers[0])

    def broker_config(self) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "authentication_enabled": True,
            "authentication_providers": ["token"],
            "superuser_roles": [*self.superusers, self.broker_role],
            "broker_client_auth_token": self.token(self.broker_role),
        }
        if self.secret:
            fields["token_secret_key"] = data_spec(self.secret)
        else:
            fields["token_public_key"] = data_spec(self.public_key)
        fields.update(self.extra)
        return fields
