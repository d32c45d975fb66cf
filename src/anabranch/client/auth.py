"""Client credentials, named like the official client's: :class:`AuthenticationToken`,
:class:`AuthenticationBasic` and :class:`AuthenticationTLS`.

An authentication object names its method (Pulsar's ``token`` / ``basic`` / ``tls``), gives
the bytes CONNECT (and an AUTH_RESPONSE to the broker's AUTH_CHALLENGE) carries, and the
``Authorization`` header of admin HTTP calls. A token may be a callable, asked again each
time credentials are sent, so a refreshed token is picked up when the broker challenges an
expired one.

Example:
    >>> auth = AuthenticationToken("eyJ...")
    >>> (auth.method, auth.auth_data(), auth.http_header())
    ('token', b'eyJ...', 'Bearer eyJ...')
    >>> AuthenticationBasic("ann", "pw").http_header()
    'Basic YW5uOnB3'
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path


class Authentication:
    """Base class: no credentials (the broker's anonymous role, if it has one)."""

    method = ""

    def auth_data(self) -> bytes:
        """What CONNECT's ``auth_data`` carries."""
        return b""

    def http_header(self) -> str | None:
        """The ``Authorization`` header value for admin HTTP calls (None: none)."""
        return None

    @property
    def tls_cert_chain(self) -> tuple[str, str] | None:
        """``(certificate file, key file)`` the TLS handshake presents, if any."""
        return None


class AuthenticationToken(Authentication):
    """A JWT (``pulsar.AuthenticationToken``): a string, or a callable returning one."""

    method = "token"

    def __init__(self, token: str | Callable[[], str]) -> None:
        self._token = token

    @classmethod
    def from_file(cls, path: str | Path) -> AuthenticationToken:
        """A token read from ``path`` each time it is sent (Pulsar's ``file:///`` form)."""
        return cls(lambda: Path(path).read_text().strip())

    def token(self) -> str:
        """The current token."""
        return self._token() if callable(self._token) else self._token

    def auth_data(self) -> bytes:
        return self.token().encode("utf-8")

    def http_header(self) -> str:
        return f"Bearer {self.token()}"


class AuthenticationBasic(Authentication):
    """User and password checked against the broker's htpasswd file."""

    method = "basic"

    def __init__(self, username: str, password: str) -> None:
        self.username = username
        self._password = password

    def auth_data(self) -> bytes:
        return f"{self.username}:{self._password}".encode()

    def http_header(self) -> str:
        return "Basic " + base64.b64encode(self.auth_data()).decode("ascii")


class AuthenticationTLS(Authentication):
    """A client certificate (role = its CN) presented in the TLS handshake."""

    method = "tls"

    def __init__(self, certificate_path: str | Path, private_key_path: str | Path) -> None:
        self.certificate_path = str(certificate_path)
        self.private_key_path = str(private_key_path)

    @property
    def tls_cert_chain(self) -> tuple[str, str]:
        return (self.certificate_path, self.private_key_path)
