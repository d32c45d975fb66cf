"""The admin client's transport failures are one typed, retriable error (not aiohttp's),
and a URL it cannot use is refused when the client is made."""

from __future__ import annotations

import socket

import pytest

from anabranch.admin.client import AdminClient, AdminUnreachable
from anabranch.errors import InvalidArgument


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_unreachable_broker_is_admin_unreachable() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    async with AdminClient(url) as admin:
        with pytest.raises(AdminUnreachable) as info:
            await admin.list_tenants()
    assert info.value.retriable and info.value.url == url
    assert str(info.value).startswith(f"cannot reach the admin API at {url}: ")


@pytest.mark.parametrize("url", ["not a url", "127.0.0.1:8080", "pulsar://127.0.0.1:6650"])
def test_a_url_without_http_is_invalid_argument(url: str) -> None:
    with pytest.raises(InvalidArgument, match="not http:// or https://"):
        AdminClient(url)
