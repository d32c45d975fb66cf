"""TLS client-certificate authentication (Pulsar's ``AuthenticationProviderTls``): the
role is the common name (CN) of the client certificate the TLS handshake verified against
``tls_trust_certs_file_path``.

Example:
    >>> import asyncio
    >>> cert = {"subject": ((("organizationName", "acme"),), (("commonName", "svc-a"),))}
    >>> asyncio.run(TlsProvider().authenticate(Credentials(b"", cert))).role
    'svc-a'
    >>> common_name({"subject": ()}) is None
    True
"""

from __future__ import annotations

from anabranch.errors import AuthenticationError
from anabranch.security.authentication import Authenticated, Credentials, PeerCertificate


def common_name(certificate: PeerCertificate) -> str | None:
    """The (last) CN of a ``getpeercert()`` subject, or None."""
    found: str | None = None
    subject = certificate.get("subject", ())
    if not isinstance(subject, tuple):
        return None
    for rdn in subject:
        for attribute in rdn:
            if len(attribute) == 2 and attribute[0] == "commonName":
                found = str(attribute[1])
    return found


class TlsProvider:
    """Role = the verified client certificate's CN."""

    method = "tls"

    async def authenticate(self, credentials: Credentials) -> Authenticated:
        cert = credentials.peer_certificate
        if not cert:
            raise AuthenticationError("no trusted client certificate")
        role = common_name(cert)
        if not role:
            raise AuthenticationError("client certificate has no common name")
        return Authenticated(role)
