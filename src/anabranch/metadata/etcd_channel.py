"""The gRPC channel to etcd: endpoints, TLS and user/password authentication.

:class:`EtcdOptions` is what a broker's settings say about reaching etcd; :class:`EtcdChannel`
is the open channel with the stubs :mod:`anabranch.metadata.etcd` calls and the call
metadata (etcd's auth token) every call must carry.

* Several endpoints: the hosts are resolved once at open and handed to gRPC as one target
  (``ipv4:a:p,b:p``) with the ``pick_first`` policy, so a call fails over to the next
  member when the connected one goes away.
* TLS: a CA bundle (``tls_trust_certs_file``) and, for client-certificate authentication,
  a certificate and key. The name the server certificate must carry is the first
  endpoint's host, as a client of a single endpoint would check.
* User/password: etcd's ``Authenticate`` gives a token sent with every call; etcd's
  simple tokens expire after idling, so :meth:`EtcdChannel.reauthenticate` fetches a new
  one (the store calls it when etcd answers UNAUTHENTICATED).

Example:
    >>> EtcdOptions.parse_endpoints("10.0.0.1:2379, http://etcd-2:2379")
    [('10.0.0.1', 2379), ('etcd-2', 2379)]
    >>> EtcdOptions(username="u").check()
    Traceback (most recent call last):
    ...
    anabranch.errors.InvalidArgument: etcd username and password go together
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anabranch import limits
from anabranch.errors import InvalidArgument

if TYPE_CHECKING:  # imported when a channel opens: grpc costs a standalone broker ~11 MB
    import grpc


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd beyond its endpoints (all optional: plain, anonymous by default)."""

    username: str | None = None
    password: str | None = None
    tls_trust_certs_file: Path | None = None
    """CA bundle the servers' certificates are checked against; setting it turns TLS on."""
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @property
    def tls(self) -> bool:
        return self.tls_trust_certs_file is not None

    def check(self) -> None:
        """InvalidArgument for settings that cannot work together."""
        if (self.username is None) != (self.password is None):
            raise InvalidArgument("etcd username and password go together")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise InvalidArgument("etcd TLS certificate and key go together")
        if self.tls_cert_file is not None and not self.tls:
            raise InvalidArgument("an etcd client certificate needs a trust-certs file (TLS)")

    @staticmethod
    def parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
        """``host:port`` pairs of a comma-separated list (``http(s)://`` prefixes ignored)."""
        parsed = []
        for raw in endpoints.split(","):
            endpoint = raw.strip().removeprefix("http://").removeprefix("https://")
            host, sep, port = endpoint.rpartition(":")
            host = host.removeprefix("[").removesuffix("]")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgument(f"etcd endpoint must be host:port, not {raw.strip()!r}")
            parsed.append((host, int(port)))
        return parsed


def _read(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as err:
        raise InvalidArgument(f"cannot read etcd TLS file {path.name!r}: {err.strerror}") from err


async def _target(endpoints: list[tuple[str, int]]) -> str:
    """One gRPC target for all endpoints (a single one stays a DNS name)."""
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    loop = asyncio.get_running_loop()
    addresses: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    ports: list[int] = []
    for host, port in endpoints:
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            raise InvalidArgument(f"etcd endpoint {host!r} does not resolve") from err
        addresses.append(ipaddress.ip_address(infos[0][4][0]))
        ports.append(port)
    if len({a.version for a in addresses}) != 1:
        raise InvalidArgument("etcd endpoints must all be IPv4 or all IPv6")
    if addresses[0].version == 4:
        return "ipv4:" + ",".join(f"{a}:{p}" for a, p in zip(addresses, ports, strict=True))
    return "ipv6:" + ",".join(f"[{a}]:{p}" for a, p in zip(addresses, ports, strict=True))


class EtcdChannel:
    """An open channel to etcd with the stubs the store uses and the call metadata."""

    def __init__(self, channel: grpc.aio.Channel, options: EtcdOptions) -> None:
        from aetcd import rpc

        self.channel = channel
        self.options = options
        self.kvstub = rpc.KVStub(channel)
        self.leasestub = rpc.LeaseStub(channel)
        self.watchstub = rpc.WatchStub(channel)
        self._auth = rpc.AuthStub(channel)
        self.metadata: tuple[tuple[str, str], ...] | None = None

    @classmethod
    async def open(
        cls, endpoints: str, options: EtcdOptions, channel_options: dict[str, Any]
    ) -> EtcdChannel:
        """A channel to ``endpoints``, authenticated when ``options`` carry a user."""
        import grpc

        options.check()
        parsed = EtcdOptions.parse_endpoints(endpoints)
        target = await _target(parsed)
        grpc_options = [*channel_options.items(), ("grpc.lb_policy_name", "pick_first")]
        if options.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(options.tls_trust_certs_file),
                private_key=_read(options.tls_key_file),
                certificate_chain=_read(options.tls_cert_file),
            )
            # An ipv4:/ipv6: target has no name to check the certificate against.
            grpc_options.append(("grpc.ssl_target_name_override", parsed[0][0]))
            channel = grpc.aio.secure_channel(target, credentials, options=grpc_options)
        else:
            channel = grpc.aio.insecure_channel(target, options=grpc_options)
        opened = cls(channel, options)
        if options.username is not None:
            try:
                await opened.reauthenticate()
            except BaseException:
                await channel.close()
                raise
        return opened

    async def reauthenticate(self) -> None:
        """Fetch a fresh auth token (etcd's simple tokens expire when idle)."""
        from aetcd import rpc

        request = rpc.AuthenticateRequest(
            name=self.options.username, password=self.options.password
        )
        response = await self._auth.Authenticate(request, timeout=limits.ETCD_REQUEST_TIMEOUT_S)
        self.metadata = (("token", response.token),)

    async def close(self) -> None:
        await self.channel.close()
