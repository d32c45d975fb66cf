"""Server-side TLS: the ``ssl.SSLContext`` of the ``pulsar+ssl://`` and HTTPS listeners.

The broker presents ``tls_certificate_file_path``/``tls_key_file_path``. With
``tls_trust_certs_file_path`` set it asks for a client certificate and verifies it against
that bundle (TLS authentication takes the CN as the role): optional by default, required
with ``tls_require_trusted_client_cert_on_connect``. An untrusted certificate fails the
TLS handshake itself. TLS 1.2 is the minimum, as in Pulsar.

Example:
    >>> from pathlib import Path
    >>> from anabranch.broker.config import BrokerConfig
    >>> cfg = BrokerConfig(data_dir=Path("/tmp/ab"))
    >>> server_ssl_context(cfg) is None
    True
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

from anabranch.errors import InvalidArgument

if TYPE_CHECKING:
    from anabranch.broker.config import BrokerConfig


def server_ssl_context(config: BrokerConfig) -> ssl.SSLContext | None:
    """The listeners' context (None while ``tls_enabled`` is off). Reads the files once,
    at start-up; InvalidArgument names the setting that could not be loaded."""
    if not config.tls_enabled:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_certificate_file_path, config.tls_key_file_path)
    except (OSError, ssl.SSLError) as err:
        raise InvalidArgument(f"cannot load the broker's TLS certificate or key: {err}") from err
    if config.tls_trust_certs_file_path:
        try:
            ctx.load_verify_locations(cafile=config.tls_trust_certs_file_path)
        except (OSError, ssl.SSLError) as err:
            raise InvalidArgument(f"cannot load tls_trust_certs_file_path: {err}") from err
        ctx.verify_mode = (
            ssl.CERT_REQUIRED
            if config.tls_require_trusted_client_cert_on_connect
            else ssl.CERT_OPTIONAL
        )
    elif config.tls_require_trusted_client_cert_on_connect:
        raise InvalidArgument(
            "tls_require_trusted_client_cert_on_connect needs tls_trust_certs_file_path"
        )
    return ctx


def broker_client_ssl_context(config: BrokerConfig) -> ssl.SSLContext:
    """The context this broker uses to call other brokers over TLS: it trusts
    ``broker_client_trust_certs_file_path`` (else ``tls_trust_certs_file_path``, else the
    system's CAs) and presents ``broker_client_tls_cert_file_path`` when set."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.check_hostname = False  # brokers are addressed by IP as often as by name
    trust = config.broker_client_trust_certs_file_path or config.tls_trust_certs_file_path
    try:
        if trust:
            ctx.load_verify_locations(cafile=trust)
        if config.broker_client_tls_cert_file_path:
            ctx.load_cert_chain(
                config.broker_client_tls_cert_file_path, config.broker_client_tls_key_file_path
            )
    except (OSError, ssl.SSLError) as err:
        raise InvalidArgument(f"cannot load the broker client's TLS files: {err}") from err
    return ctx
