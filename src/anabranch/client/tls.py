"""The client side of TLS: the ``ssl.SSLContext`` for ``pulsar+ssl://`` and ``https://``.

Options as the official client names them: ``tls_trust_certs_file_path`` (CA bundle; the
system's when empty), ``tls_allow_insecure_connection`` (no certificate check at all),
``tls_validate_hostname`` (the broker's certificate must name the host; upstream's default
is off, and so is ours), and the client certificate of :class:`AuthenticationTLS`.

Example:
    >>> ctx = client_ssl_context(TlsOptions(allow_insecure_connection=True))
    >>> (ctx.verify_mode == ssl.CERT_NONE, ctx.check_hostname)
    (True, False)
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from anabranch.errors import InvalidArgument


@dataclass(frozen=True)
class TlsOptions:
    """How a client checks the broker's certificate, and the one it presents."""

    trust_certs_file_path: str | None = None
    allow_insecure_connection: bool = False
    validate_hostname: bool = False
    cert_chain: tuple[str, str] | None = None
    """``(certificate file, key file)`` for TLS client authentication."""


def client_ssl_context(options: TlsOptions) -> ssl.SSLContext:
    """An SSL context for ``options`` (InvalidArgument when a file cannot be loaded)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if options.allow_insecure_connection:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        else:
            ctx.check_hostname = options.validate_hostname
            if options.trust_certs_file_path:
                ctx.load_verify_locations(cafile=options.trust_certs_file_path)
        if options.cert_chain is not None:
            ctx.load_cert_chain(*options.cert_chain)
    except (OSError, ssl.SSLError) as err:
        raise InvalidArgument(f"cannot load TLS files: {err}") from err
    return ctx
