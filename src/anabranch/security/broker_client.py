"""The credentials a broker presents to other brokers (Pulsar's
``brokerClientAuthenticationPlugin``/``brokerClientAuthenticationParameters``): on the
admin HTTP calls between brokers (controller-to-broker segment operations, forwarded
unloads) and on the binary handshakes of liveness probes.

A token (``broker_client_auth_token``: the JWT, or ``file:///path`` read at each use so a
rotated file is picked up) goes as ``Authorization: Bearer`` and as CONNECT's ``token``;
without one, a client certificate (``broker_client_tls_cert_file_path``) authenticates
over TLS. ``https://`` and ``pulsar+ssl://`` peers are verified against
``broker_client_trust_certs_file_path`` (else ``tls_trust_certs_file_path``).

Example:
    >>> from pathlib import Path
    >>> from anabranch.broker.config import BrokerConfig
    >>> creds = BrokerClientCredentials.from_config(BrokerConfig(data_dir=Path("/tmp/ab"),
    ...                                             broker_client_auth_token="eyJ.x.y"))
    >>> creds.http_headers(), creds.connect_auth()
    ({'Authorization': 'Bearer eyJ.x.y'}, ('token', b'eyJ.x.y'))
    >>> creds.ssl_for("http://b2:8080") is None
    True
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from anabranch.security.tls import broker_client_ssl_context

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig


@dataclass
class BrokerClientCredentials:
    """What this broker shows other brokers (see the module docstring)."""

    token_setting: str = ""
    has_client_certificate: bool = False
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def from_config(cls, config: BrokerConfig) -> BrokerClientCredentials:
        tls_in_use = bool(
            config.tls_enabled
            or config.broker_client_tls_cert_file_path
            or config.broker_client_trust_certs_file_path
        )
        return cls(
            token_setting=config.broker_client_auth_token,
            has_client_certificate=bool(config.broker_client_tls_cert_file_path),
            ssl_context=broker_client_ssl_context(config) if tls_in_use else None,
        )

    def token(self) -> str | None:
        """The token to send, if any (a ``file://`` setting is read now)."""
        setting = self.token_setting.strip()
        if not setting:
            return None
        if setting.startswith("file://"):
            return Path(setting.removeprefix("file://")).read_text().strip()
        return setting

    def http_headers(self) -> dict[str, str]:
        """Headers for an admin HTTP call to another broker."""
        token = self.token()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def connect_auth(self) -> tuple[str | None, bytes | None]:
        """CONNECT's ``(auth_method_name, auth_data)`` for a handshake with another broker."""
        token = self.token()
        if token:
            return "token", token.encode("utf-8")
        if self.has_client_certificate:
            return "tls", b""
        return None, None

    def ssl_for(self, url: str) -> ssl.SSLContext | None:
        """The SSL context for ``url`` (None for ``http://`` and ``pulsar://``)."""
        if url.startswith(("https://", "pulsar+ssl://")):
            return self.ssl_context or ssl.create_default_context()
        return None
