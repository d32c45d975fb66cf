"""A broker behind a proxy or NAT advertises the ports clients must use, not its own.

Lookups (binary and HTTP) and the DAG name the advertised ``pulsar://`` URL; the admin
HTTP redirects name the advertised HTTP port. The fault harness relies on it to put a
cuttable proxy in front of every broker.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp

from anabranch.aio import Client
from anabranch.testing.broker import InProcessBroker
from anabranch.testing.tcp_proxy import TcpProxy


async def test_lookups_name_the_advertised_port_and_clients_get_through_it(
    tmp_path: Path,
) -> None:
    # The proxy must exist before the broker knows its port: point it at the broker later.
    proxy = await TcpProxy.start("127.0.0.1", 1)
    try:
        async with InProcessBroker(tmp_path, advertised_port=proxy.port) as broker:
            proxy.target_port = broker.port
            assert broker.service_url == f"pulsar://127.0.0.1:{proxy.port}"
            assert broker.http_url is not None
            url = f"{broker.http_url}/lookup/v2/topic/persistent/public/default/adv"
            async with aiohttp.ClientSession() as http, http.get(url) as response:
                assert response.status == 200
                assert (await response.json())["brokerUrl"] == broker.service_url
            before = proxy.connections_total
            async with Client(broker.service_url) as client:
                producer = await client.create_producer("persistent://public/default/adv")
                await producer.send(b"through the proxy")
            assert proxy.connections_total > before
    finally:
        await proxy.close()
