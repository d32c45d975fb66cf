"""Certificates for TLS tests, made on the spot (never checked in): a CA, a server
certificate for ``127.0.0.1``/``localhost`` and client certificates with a chosen CN.

Example:
    >>> import tempfile
    >>> pki = TestPki.create(Path(tempfile.mkdtemp()))
    >>> cert, key = pki.client("alice")
    >>> cert.name, pki.server_cert.exists(), pki.ca_cert.exists()
    ('alice.cert.pem', True, True)
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from anabranch.testing.security import BrokerSecurity

VALID_FOR = datetime.timedelta(days=2)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


@dataclass
class TestPki:
    """A throw-away CA under ``directory`` and the certificates it signed."""

    directory: Path
    ca_key: ec.EllipticCurvePrivateKey
    ca: x509.Certificate
    ca_cert: Path
    server_cert: Path = field(init=False)
    server_key: Path = field(init=False)

    __test__ = False  # not a pytest test class

    @classmethod
    def create(cls, directory: Path, *, ca_name: str = "anabranch-test-ca") -> TestPki:
        """A new CA plus a server certificate for 127.0.0.1, ::1 and localhost."""
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        ca = (
            x509.CertificateBuilder()
            .subject_name(_name(ca_name))
            .issuer_name(_name(ca_name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        ca_cert = directory / "ca.cert.pem"
        ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        pki = cls(directory, key, ca, ca_cert)
        pki.server_cert, pki.server_key = pki.issue("localhost", server=True, file_stem="server")
        return pki

    def issue(
        self, cn: str, *, server: bool = False, file_stem: str | None = None
    ) -> tuple[Path, Path]:
        """A certificate for ``cn`` signed by this CA: ``(cert PEM, key PEM)`` paths."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()),
                critical=False,
            )
        )
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            names: list[x509.GeneralName] = [
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.ca_key, hashes.SHA256())
        stem = file_stem or cn
        cert_path = self.directory / f"{stem}.cert.pem"
        key_path = self.directory / f"{stem}.key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return cert_path, key_path

    def client(self, cn: str) -> tuple[Path, Path]:
        """A client certificate whose CN (the TLS-authentication role) is ``cn``."""
        return self.issue(cn)


@dataclass
class TlsSetup:
    """TLS listeners (and optionally TLS authentication) for a test broker; a
    :class:`~anabranch.testing.security.BrokerSecurity` for ``InProcessBroker(security=)``.

    ``authenticate`` adds the ``tls`` provider; ``plaintext`` False turns the plain ports
    off; ``also`` merges another set-up (e.g. a ``TokenAuth``), providers combined.
    """

    pki: TestPki
    authenticate: bool = False
    require_client_cert: bool = False
    plaintext: bool = True
    also: BrokerSecurity | None = None

    @property
    def superuser_token(self) -> str | None:
        """The combined set-up's superuser token, if it has one (a ``TokenAuth``)."""
        token = getattr(self.also, "superuser_token", None)
        return token if isinstance(token, str) else None

    def broker_config(self) -> dict[str, Any]:
        fields: dict[str, Any] = dict(self.also.broker_config()) if self.also else {}
        fields.update(
            {
                "tls_enabled": True,
                "broker_service_port_tls": 0,
                "web_service_port_tls": 0,
                "tls_certificate_file_path": str(self.pki.server_cert),
                "tls_key_file_path": str(self.pki.server_key),
                "tls_trust_certs_file_path": str(self.pki.ca_cert),
                "tls_require_trusted_client_cert_on_connect": self.require_client_cert,
                "plaintext_enabled": self.plaintext,
            }
        )
        if self.authenticate:
            providers = list(fields.get("authentication_providers", []))
            fields["authentication_enabled"] = True
            fields["authentication_providers"] = [*providers, "tls"]
        return fields
