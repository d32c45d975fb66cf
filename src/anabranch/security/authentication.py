"""Who is this client? Providers turn credentials into a role (Pulsar's model).

A provider owns one auth method, named as Pulsar names it (``token``, ``basic``,
``tls``), and answers :meth:`AuthenticationProvider.authenticate` with an
:class:`Authenticated` (the role, and when the credentials expire) or raises
:class:`~anabranch.errors.AuthenticationError`. The :class:`AuthenticationService` holds
the providers the broker configuration enables and is what the binary sessions (CONNECT,
AUTH_RESPONSE) and the HTTP middleware ask.

With ``authentication_enabled`` off the broker never builds a service: every session's
``role`` and every request's ``request["anabranch.role"]`` is None.

Example:
    >>> import asyncio
    >>> class Fixed:
    ...     method = "fixed"
    ...     async def authenticate(self, credentials: Credentials) -> Authenticated:
    ...         return Authenticated(credentials.data.decode())
    >>> service = AuthenticationService([Fixed()])
    >>> asyncio.run(service.authenticate("fixed", Credentials(b"alice"))).role
    'alice'
    >>> asyncio.run(service.authenticate("other", Credentials(b"x")))
    Traceback (most recent call last):
    ...
    anabranch.errors.AuthenticationError: authentication failed: auth method 'other' is not enabled
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from anabranch.errors import AuthenticationError

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig


PeerCertificate = dict[str, object]
"""``ssl.SSLObject.getpeercert()`` of a verified client certificate."""


@dataclass(frozen=True)
class Credentials:
    """What a client presented: the method's data (a token, ``user:password``, empty for
    TLS) and, on a TLS connection with a verified client certificate, that certificate."""

    data: bytes
    peer_certificate: PeerCertificate | None = None


@dataclass(frozen=True)
class Authenticated:
    """A successful authentication: the role, and the Unix time the credentials stop
    being valid (None: never)."""

    role: str
    expires_at: float | None = None


class AuthenticationProvider(Protocol):
    """One auth method (Pulsar's ``AuthenticationProvider``)."""

    @property
    def method(self) -> str:
        """Pulsar's method name: ``token``, ``basic`` or ``tls``."""
        ...

    async def authenticate(self, credentials: Credentials) -> Authenticated:
        """The role these credentials prove; AuthenticationError otherwise."""
        ...


class AuthenticationService:
    """The enabled providers by method name, plus the anonymous role (if any)."""

    def __init__(
        self,
        providers: list[AuthenticationProvider],
        *,
        anonymous_role: str | None = None,
    ) -> None:
        self.providers = {p.method: p for p in providers}
        self.anonymous_role = anonymous_role

    @classmethod
    def from_config(cls, config: BrokerConfig) -> AuthenticationService | None:
        """The service ``config`` asks for; None when authentication is disabled.
        Reads key and htpasswd files (start-up only)."""
        if not config.authentication_enabled:
            return None
        from anabranch.security.providers_basic import BasicProvider
        from anabranch.security.providers_tls import TlsProvider
        from anabranch.security.providers_token import TokenProvider

        providers: list[AuthenticationProvider] = []
        for name in dict.fromkeys(config.authentication_providers):
            if name == "token":
                providers.append(TokenProvider.from_config(config))
            elif name == "basic":
                providers.append(BasicProvider.from_config(config))
            else:
                providers.append(TlsProvider())
        return cls(providers, anonymous_role=config.anonymous_user_role)

    @property
    def methods(self) -> list[str]:
        """The enabled method names."""
        return list(self.providers)

    async def authenticate(self, method: str, credentials: Credentials) -> Authenticated:
        """The role ``credentials`` prove under ``method``.

        An empty ``method`` (a client configured without auth) is the anonymous role when
        one is configured; a TLS client that names no method but shows a verified
        certificate is tried with the ``tls`` provider. A method no provider serves is
        also the anonymous role when there is one, as on Pulsar: clients configured
        without auth name the method ``none``.

        Example:
            >>> import asyncio
            >>> service = AuthenticationService([], anonymous_role="anonymous")
            >>> asyncio.run(service.authenticate("none", Credentials(b""))).role
            'anonymous'
        """
        if not method:
            if credentials.peer_certificate and "tls" in self.providers:
                method = "tls"
            elif self.anonymous_role is not None:
                return Authenticated(self.anonymous_role)
            else:
                raise AuthenticationError("no credentials")
        provider = self.providers.get(method)
        if provider is None:
            if self.anonymous_role is not None:
                return Authenticated(self.anonymous_role)
            raise AuthenticationError(f"auth method {method!r} is not enabled")
        return await provider.authenticate(credentials)
