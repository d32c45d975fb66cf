"""Behaviours the official ``pulsar-client`` test suite relies on, checked with the official
client against our broker (regressions found by running that suite; our own tests).

Schema evolution: upstream's validator (Avro's resolving grammar) matches records by their
fields, not their names, so a producer whose record class was renamed may still evolve a
topic's schema when the fields resolve; a renamed record whose fields do not resolve is
still refused.

Anonymous role: a client configured without authentication names the method ``none``
(and a misconfigured one may name any method no provider serves); with
``anonymous_user_role`` set, Pulsar gives such a connection that role, so authorization
then decides, instead of refusing the connection.

Missing tenant: with authorization on, Pulsar checks the topic's tenant before the grants
and answers PARTITIONED_METADATA for a tenant that does not exist with TopicNotFound, not
AuthorizationError (the suite's asyncio ``test_create_producer_failure``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pulsar
from pulsar.schema import Integer, JsonSchema, Record, String

from anabranch import AuthenticationBasic
from anabranch.admin.client import AdminClient
from anabranch.testing.broker import InProcessBroker


class Order(Record):  # type: ignore[misc]
    sku = String()
    qty = Integer()


# Renamed; qty now required: FORWARD (old readers still read it).
class OrderV2(Record):  # type: ignore[misc]
    _sorted_fields = True
    sku = String()
    qty = Integer(required=True)


# Renamed; the same fields with defaults: FULL.
class OrderDefaults(Record):  # type: ignore[misc]
    sku = String(required_default=True)
    qty = Integer(required_default=True)


# Renamed; sku is no longer a string: compatible under no strategy.
class OrderBroken(Record):  # type: ignore[misc]
    sku = Integer(required=True)
    qty = Integer()


def evolve(url: str, topic: str, first: type[Record], then: type[Record]) -> str:
    """Create a producer with ``first`` then one with ``then`` on ``topic``; the outcome of
    the second, after a consumer with ``first`` read one message of each."""
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        old = client.create_producer(topic, schema=JsonSchema(first))
        consumer = client.subscribe(topic, "readers", schema=JsonSchema(first))
        try:
            new = client.create_producer(topic, schema=JsonSchema(then))
        except pulsar.PulsarException as err:
            return type(err).__name__
        old.send(first(sku="a-1", qty=1))
        new.send(then(sku="b-2", qty=2))
        got = [consumer.receive(10_000).value() for _ in range(2)]
        assert [(o.sku, o.qty) for o in got] == [("a-1", 1), ("b-2", 2)]
        return "ok"
    finally:
        client.close()


async def test_a_renamed_record_evolves_by_its_fields(tmp_path: Path) -> None:
    async with InProcessBroker(tmp_path) as broker:
        assert broker.http_url is not None
        url, base = broker.service_url, "persistent://public/default/suite-orders"
        # The broker's default strategy (FULL) takes a renamed record with defaults ...
        assert await asyncio.to_thread(evolve, url, f"{base}-full", Order, OrderDefaults) == "ok"
        # ... but not one whose field type changed, renamed or not.
        refused = await asyncio.to_thread(evolve, url, f"{base}-broken", Order, OrderBroken)
        assert refused == "IncompatibleSchema"
        async with AdminClient(broker.http_url) as admin:
            await admin.set_schema_compatibility_strategy("public/default", "FORWARD")
        assert await asyncio.to_thread(evolve, url, f"{base}-forward", Order, OrderV2) == "ok"


@contextlib.asynccontextmanager
async def anonymous_broker(tmp_path: Path, grants: list[str]) -> AsyncIterator[InProcessBroker]:
    """Basic auth (superuser ``root``), the anonymous role for everyone else, authorization
    on; ``public/closed`` with no grants, ``grants`` to the anonymous role on
    ``public/default``."""
    htpasswd = tmp_path / "htpasswd"
    digest = base64.b64encode(hashlib.sha1(b"root-pw").digest()).decode()
    htpasswd.write_text(f"root:{{SHA}}{digest}\n")
    async with InProcessBroker(
        tmp_path / "data",
        authentication_enabled=True,
        authentication_providers=["basic"],
        basic_auth_conf=f"file://{htpasswd}",
        anonymous_user_role="anonymous",
        authorization_enabled=True,
        superuser_roles=["root"],
    ) as broker:
        assert broker.http_url is not None
        admin_auth = AuthenticationBasic("root", "root-pw")
        async with AdminClient(broker.http_url, auth=admin_auth) as admin:
            await admin.create_namespace("public/closed")
            await admin.grant_namespace_permission("public/default", "anonymous", grants)
        yield broker


def round_trip(url: str, topic: str, auth: pulsar.Authentication | None = None) -> str:
    """Produce and consume one message on ``topic``; "ok" or the error's class name."""
    client = pulsar.Client(url, authentication=auth, operation_timeout_seconds=30)
    try:
        consumer = client.subscribe(topic, "anon")
        client.create_producer(topic).send(b"hi")
        assert consumer.receive(10_000).data() == b"hi"
        return "ok"
    except pulsar.PulsarException as err:
        return type(err).__name__
    finally:
        client.close()


async def test_clients_without_a_served_method_get_the_anonymous_role(tmp_path: Path) -> None:
    async with anonymous_broker(tmp_path, ["produce", "consume"]) as broker:
        url = broker.service_url
        opened, closed = "persistent://public/default/anon", "persistent://public/closed/anon"
        # No auth configured: the official client names the method "none".
        assert await asyncio.to_thread(round_trip, url, opened) == "ok"
        # A method no provider serves is anonymous too: authorization, not authentication,
        # refuses it where the anonymous role has no grant.
        unknown = pulsar.AuthenticationBasic("root", "root-pw", "unknown")
        assert await asyncio.to_thread(round_trip, url, opened, unknown) == "ok"
        assert await asyncio.to_thread(round_trip, url, closed, unknown) == "AuthorizationError"
        # The served method still authenticates: root is a superuser everywhere.
        root = pulsar.AuthenticationBasic("root", "root-pw")
        assert await asyncio.to_thread(round_trip, url, closed, root) == "ok"


def producer_outcome(url: str, topic: str) -> str:
    """Create a producer on ``topic`` without credentials; "ok" or the error's class name."""
    client = pulsar.Client(url, operation_timeout_seconds=30)
    try:
        client.create_producer(topic)
        return "ok"
    except pulsar.PulsarException as err:
        return type(err).__name__
    finally:
        client.close()


async def test_a_missing_tenant_is_topic_not_found_under_authorization(tmp_path: Path) -> None:
    async with anonymous_broker(tmp_path, ["produce"]) as broker:
        url = broker.service_url
        outcome = await asyncio.to_thread(producer_outcome, url, "tenant/ns/none-such")
        assert outcome == "TopicNotFound"
        # An existing tenant is still refused by its grants, namespace or no namespace.
        for topic in ("public/closed/t", "public/none-such/t"):
            assert await asyncio.to_thread(producer_outcome, url, topic) == "AuthorizationError"
        assert await asyncio.to_thread(producer_outcome, url, "public/default/t") == "ok"
