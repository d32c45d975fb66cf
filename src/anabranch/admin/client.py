"""A small async admin client over aiohttp (used by the CLI and by tests).

Every method is one admin v2 request. Topic arguments take full or short names
(``persistent://t/ns/x``, ``t/ns/x``, ``x``); answers are decoded JSON. A non-2xx answer
raises :class:`AdminHttpError` carrying the status and Pulsar's ``reason``.

Security: ``auth_token=`` (or ``auth=`` an ``AuthenticationToken``/``AuthenticationBasic``/
``AuthenticationTLS``) adds the ``Authorization`` header (or the client certificate); an
``https://`` URL verifies the broker against ``tls_trust_certs_file_path``.

Example:
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(http_url: str) -> None:        # e.g. "http://127.0.0.1:8080"
    ...     async with AdminClient(http_url) as admin:
    ...         await admin.create_partitioned_topic("orders", 4)
    ...         assert await admin.get_partitions("orders") == 4
    ...         print((await admin.stats("orders-partition-0"))["msgInCounter"])
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.http_url or "")
    >>> asyncio.run(main())
    0
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from anabranch.admin.messages import decode_peeked
from anabranch.client.auth import Authentication, AuthenticationToken
from anabranch.client.tls import TlsOptions, client_ssl_context
from anabranch.core.names import NamespaceName, SegmentName, TopicDomain, TopicName
from anabranch.errors import AnabranchError, InvalidArgument

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"
ADMIN_REQUEST_TIMEOUT_S = 30.0
"""An admin request without an answer after this fails (aiohttp's total timeout)."""


class AdminHttpError(AnabranchError):
    """The admin API answered an error status; ``reason`` is its ``{"reason"}`` text."""

    def __init__(self, method: str, path: str, status: int, reason: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {reason}")
        self.method = method
        self.path = path
        self.status = status
        self.reason = reason
        self.http_status = status
        self.retriable = status >= 500


class AdminUnreachable(AnabranchError):
    """No answer from the admin API: refused, unresolvable, reset or timed out
    (retriable); ``reason`` is the transport's own words."""

    retriable = True
    http_status = 503

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach the admin API at {url}: {reason}")
        self.url = url
        self.reason = reason


def _q(part: str) -> str:
    return quote(part, safe="")


def _topic_path(topic: str) -> str:
    name = TopicName.parse(topic)
    return f"/admin/v2/{name.domain.value}/{_q(name.tenant)}/{_q(name.namespace)}/" + _q(
        name.full_local_name
    )


def _ns_path(namespace: str) -> str:
    ns = NamespaceName.parse(namespace)
    return f"/admin/v2/namespaces/{_q(ns.tenant)}/{_q(ns.namespace)}"


def _dispatch_rate_path(target: str, subscription: bool) -> str:
    return (
        f"{_policy_path(target)}/{'subscriptionDispatchRate' if subscription else 'dispatchRate'}"
    )


def _policy_path(target: str) -> str:
    """A namespace's path for ``tenant/ns``, else the topic's.

    Example:
        >>> _policy_path("public/default"), _policy_path("public/default/t")
        ('/admin/v2/namespaces/public/default', '/admin/v2/persistent/public/default/t')
    """
    if "://" not in target and target.count("/") == 1:
        return _ns_path(target)
    return _topic_path(target)


def _schema_path(topic: str) -> tuple[str, str]:
    """The schema routes' path of a topic, and the query naming its domain.

    Example:
        >>> _schema_path("topic://public/default/t")
        ('/admin/v2/schemas/public/default/t', '?domain=topic')
    """
    name = TopicName.parse(topic)
    path = f"/admin/v2/schemas/{_q(name.tenant)}/{_q(name.namespace)}/{_q(name.local_name)}"
    return path, "" if name.domain.value == "persistent" else f"?domain={name.domain.value}"


def _scalable_path(topic: str) -> str:
    """``/admin/v2/scalable/t/ns/x`` of a scalable topic (``topic://t/ns/x``, ``t/ns/x``, ``x``)."""
    name = TopicName.parse(topic, TopicDomain.TOPIC)
    if name.domain is not TopicDomain.TOPIC:
        raise InvalidArgument(f"{name} is not a scalable topic:// name")
    return f"/admin/v2/scalable/{_q(name.tenant)}/{_q(name.namespace)}/{_q(name.local_name)}"


def _autoscale_path(target: str) -> str:
    """A namespace's ``scalableAutoscale`` for ``tenant/ns``, else the scalable topic's.

    Example:
        >>> _autoscale_path("public/default")
        '/admin/v2/namespaces/public/default/scalableAutoscale'
        >>> _autoscale_path("topic://public/default/t")
        '/admin/v2/scalable/public/default/t/autoscale'
    """
    if "://" not in target and target.count("/") == 1:
        return _ns_path(target) + "/scalableAutoscale"
    return _scalable_path(target) + "/autoscale"


def _permissions_path(topic: str) -> str:
    """``.../permissions`` of a persistent (partition: its topic) or scalable topic.

    Example:
        >>> _permissions_path("topic://a/b/c")
        '/admin/v2/scalable/a/b/c/permissions'
        >>> _permissions_path("persistent://a/b/c-partition-1")
        '/admin/v2/persistent/a/b/c/permissions'
    """
    name = TopicName.parse(topic)
    if name.domain is TopicDomain.TOPIC:
        return _scalable_path(str(name)) + "/permissions"
    return _topic_path(str(name.base)) + "/permissions"


def _segment_path(segment: str) -> str:
    """``/admin/v2/segments/t/ns/x/<descriptor>`` of a ``segment://`` name."""
    name = SegmentName.parse(segment)
    topic = name.topic
    return (
        f"/admin/v2/segments/{_q(topic.tenant)}/{_q(topic.namespace)}/"
        f"{_q(topic.local_name)}/{_q(name.descriptor)}"
    )


TRANSACTIONS = "/admin/v2/transactions"
"""Where the transaction read endpoints live (upstream's ``/admin/v3/transactions`` too)."""


def _key_path(key: str, owner: str) -> str:
    """The admin path of a transaction key (``?owner=`` unless it is the no-auth owner).

    Example:
        >>> _key_path("etl-7", "")
        '/admin/v2/transactions/transaction-keys/etl-7'
        >>> _key_path("a/b", "alice").rsplit("/", 1)[1]
        'a%2Fb?owner=alice'
    """
    path = f"{TRANSACTIONS}/transaction-keys/{_q(key)}"
    return f"{path}?owner={_q(owner)}" if owner else path


def _txn_topic_path(topic: str) -> str:
    """``{t}/{ns}/{topic}`` of a persistent topic, or ``segment/{t}/{ns}/{topic}/{descriptor}``
    of a ``segment://`` name (the transaction routes' two topic forms).

    Example:
        >>> _txn_topic_path("orders")
        'public/default/orders'
    """
    if topic.startswith("segment://"):
        segment = SegmentName.parse(topic)
        name = segment.topic
        return f"segment/{_q(name.tenant)}/{_q(name.namespace)}/{_q(name.local_name)}/" + _q(
            segment.descriptor
        )
    parsed = TopicName.parse(topic)
    if parsed.domain is not TopicDomain.PERSISTENT:
        raise InvalidArgument(f"{parsed} is neither a persistent:// nor a segment:// name")
    return f"{_q(parsed.tenant)}/{_q(parsed.namespace)}/{_q(parsed.full_local_name)}"


def _coordinator_query(coordinator_id: int | None) -> str:
    return "" if coordinator_id is None else f"?coordinatorId={int(coordinator_id)}"


@contextlib.contextmanager
def _unreachable_as(url: str) -> Iterator[None]:
    """Transport failures as :class:`AdminUnreachable` (callers catch one typed error,
    not aiohttp's)."""
    try:
        yield
    except aiohttp.ClientError as err:
        raise AdminUnreachable(url, str(err) or type(err).__name__) from err
    except TimeoutError as err:
        raise AdminUnreachable(url, "no answer in time") from err


class AdminClient:
    """Async client of one broker's admin API; close it (or use ``async with``)."""

    def __init__(
        self,
        url: str = DEFAULT_ADMIN_URL,
        *,
        timeout_s: float = ADMIN_REQUEST_TIMEOUT_S,
        auth: Authentication | None = None,
        auth_token: str | None = None,
        tls_trust_certs_file_path: str | None = None,
        tls_allow_insecure_connection: bool = False,
        tls_validate_hostname: bool = False,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"admin URL {url!r} is not http:// or https://")
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        if auth_token is not None:
            auth = AuthenticationToken(auth_token)
        self.auth = auth
        self._ssl: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            cert_chain = auth.tls_cert_chain if auth is not None else None
            self._ssl = client_ssl_context(
                TlsOptions(
                    trust_certs_file_path=tls_trust_certs_file_path,
                    allow_insecure_connection=tls_allow_insecure_connection,
                    validate_hostname=tls_validate_hostname,
                    cert_chain=cert_chain,
                )
            )

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session. Idempotent."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    def _headers(self) -> dict[str, str]:
        authorization = self.auth.http_header() if self.auth is not None else None
        return {"Authorization": authorization} if authorization else {}

    @staticmethod
    def _check(method: str, path: str, status: int, raw: bytes) -> None:
        if status >= 400:
            try:
                reason = str(msgspec.json.decode(raw).get("reason", ""))
            except (msgspec.DecodeError, AttributeError):
                reason = raw.decode("utf-8", "replace")
            raise AdminHttpError(method, path, status, reason)

    async def request(
        self, method: str, path: str, body: Any = None, *, base_url: str | None = None
    ) -> Any:
        """One request; JSON-decoded answer (text for non-JSON, None for 204).
        ``base_url``: another broker of the cluster instead of this client's."""
        data = None if body is None else msgspec.json.encode(body)
        headers = self._headers()
        if data is not None:
            headers["Content-Type"] = "application/json"
        base = self.url if base_url is None else base_url.rstrip("/")
        with _unreachable_as(base):
            async with self._open().request(
                method, base + path, data=data, headers=headers
            ) as response:
                raw = await response.read()
                status, content_type = response.status, response.content_type
        self._check(method, path, status, raw)
        if status == 204 or not raw:
            return None
        if content_type == "application/json":
            return msgspec.json.decode(raw)
        return raw.decode("utf-8", "replace")

    async def request_raw(self, method: str, path: str) -> tuple[dict[str, str], bytes]:
        """One request answered with bytes: ``(headers, body)``."""
        with _unreachable_as(self.url):
            async with self._open().request(
                method, self.url + path, headers=self._headers()
            ) as response:
                raw = await response.read()
                status, headers = response.status, dict(response.headers)
        self._check(method, path, status, raw)
        return headers, raw

    # --- clusters -------------------------------------------------------------------------

    async def list_clusters(self) -> list[str]:
        return list(await self.request("GET", "/admin/v2/clusters"))

    async def get_cluster(self, name: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/admin/v2/clusters/{_q(name)}"))

    async def create_cluster(
        self, name: str, service_url: str = "", broker_service_url: str = ""
    ) -> None:
        body = {"serviceUrl": service_url, "brokerServiceUrl": broker_service_url}
        await self.request("PUT", f"/admin/v2/clusters/{_q(name)}", body)

    async def delete_cluster(self, name: str) -> None:
        await self.request("DELETE", f"/admin/v2/clusters/{_q(name)}")

    # --- tenants --------------------------------------------------------------------------

    async def list_tenants(self) -> list[str]:
        return list(await self.request("GET", "/admin/v2/tenants"))

    async def get_tenant(self, name: str) -> dict[str, Any]:
        return dict(await self.request("GET", f"/admin/v2/tenants/{_q(name)}"))

    async def create_tenant(
        self,
        name: str,
        allowed_clusters: list[str] | None = None,
        admin_roles: list[str] | None = None,
    ) -> None:
        body = {"allowedClusters": allowed_clusters or [], "adminRoles": admin_roles or []}
        await self.request("PUT", f"/admin/v2/tenants/{_q(name)}", body)

    async def update_tenant(
        self,
        name: str,
        allowed_clusters: list[str] | None = None,
        admin_roles: list[str] | None = None,
    ) -> None:
        body = {"allowedClusters": allowed_clusters or [], "adminRoles": admin_roles or []}
        await self.request("POST", f"/admin/v2/tenants/{_q(name)}", body)

    async def delete_tenant(self, name: str) -> None:
        await self.request("DELETE", f"/admin/v2/tenants/{_q(name)}")

    # --- namespaces -----------------------------------------------------------------------

    async def list_namespaces(self, tenant: str) -> list[str]:
        return list(await self.request("GET", f"/admin/v2/namespaces/{_q(tenant)}"))

    async def create_namespace(
        self, namespace: str, policies: dict[str, Any] | None = None
    ) -> None:
        await self.request("PUT", _ns_path(namespace), policies)

    async def get_namespace_policies(self, namespace: str) -> dict[str, Any]:
        return dict(await self.request("GET", _ns_path(namespace)))

    async def delete_namespace(self, namespace: str) -> None:
        await self.request("DELETE", _ns_path(namespace))

    async def namespace_topics(self, namespace: str) -> list[str]:
        return list(await self.request("GET", _ns_path(namespace) + "/topics"))

    async def get_deduplication(self, namespace: str) -> bool:
        return bool(await self.request("GET", _ns_path(namespace) + "/deduplication"))

    async def set_deduplication(self, namespace: str, enabled: bool) -> None:
        await self.request("POST", _ns_path(namespace) + "/deduplication", enabled)

    async def remove_deduplication(self, namespace: str) -> None:
        await self.request("DELETE", _ns_path(namespace) + "/deduplication")

    async def get_scalable_topic_enabled(self, namespace: str) -> bool:
        return bool(await self.request("GET", _ns_path(namespace) + "/scalableTopicEnabled"))

    async def set_scalable_topic_enabled(self, namespace: str, enabled: bool | None) -> None:
        """Set the namespace's switch; None removes it (the broker's setting applies)."""
        path = _ns_path(namespace) + "/scalableTopicEnabled"
        if enabled is None:
            await self.request("DELETE", path)
        else:
            await self.request("POST", path, enabled)

    # --- retention, message TTL, backlog quotas ------------------------------------------------
    # ``target`` is a namespace (``tenant/ns``) or a topic (``persistent://t/ns/x``,
    # ``t/ns/x``): the topic's override is addressed then.

    async def get_retention(self, target: str) -> dict[str, int] | None:
        """``{"retentionTimeInMinutes", "retentionSizeInMB"}`` (-1 unbounded, 0 none); a
        namespace without one answers the broker default, a topic without one None."""
        answer = await self.request("GET", _policy_path(target) + "/retention")
        return None if answer is None else dict(answer)

    async def set_retention(self, target: str, time_minutes: int, size_mb: int) -> None:
        body = {"retentionTimeInMinutes": time_minutes, "retentionSizeInMB": size_mb}
        await self.request("POST", _policy_path(target) + "/retention", body)

    async def remove_retention(self, target: str) -> None:
        await self.request("DELETE", _policy_path(target) + "/retention")

    async def get_message_ttl(self, target: str) -> int | None:
        answer = await self.request("GET", _policy_path(target) + "/messageTTL")
        return None if answer is None else int(answer)

    async def set_message_ttl(self, target: str, ttl_s: int) -> None:
        await self.request("POST", _policy_path(target) + "/messageTTL", ttl_s)

    async def remove_message_ttl(self, target: str) -> None:
        await self.request("DELETE", _policy_path(target) + "/messageTTL")

    # --- per-topic caps (producers, consumers, subscriptions) -------------------------------

    async def get_cap(self, target: str, cap: str, *, applied: bool = False) -> int | None:
        """A cap of a namespace or topic by its REST name (``maxProducersPerTopic`` on a
        namespace, ``maxProducers`` on a topic, ...; 0: none, None: unset); ``applied``: the
        one in force on a topic."""
        query = "?applied=true" if applied else ""
        answer = await self.request("GET", f"{_policy_path(target)}/{cap}{query}")
        return None if answer is None else int(answer)

    async def set_cap(self, target: str, cap: str, value: int) -> None:
        """Set a cap (see :meth:`get_cap`; 0: none)."""
        await self.request("POST", f"{_policy_path(target)}/{cap}", value)

    async def remove_cap(self, target: str, cap: str) -> None:
        """Remove a cap (the next level's applies)."""
        await self.request("DELETE", f"{_policy_path(target)}/{cap}")

    # --- inactive topic policies --------------------------------------------------------

    async def get_inactive_topic_policies(
        self, target: str, *, applied: bool = False
    ) -> dict[str, Any] | None:
        """``{"inactiveTopicDeleteMode", "maxInactiveDurationSeconds",
        "deleteWhileInactive"}`` of a namespace or topic (None: unset); ``applied``: the
        policy in force on a topic."""
        query = "?applied=true" if applied else ""
        answer = await self.request("GET", f"{_policy_path(target)}/inactiveTopicPolicies{query}")
        return None if answer is None else dict(answer)

    async def set_inactive_topic_policies(
        self,
        target: str,
        *,
        delete_while_inactive: bool,
        max_inactive_duration_s: int,
        mode: str = "delete_when_no_subscriptions",
    ) -> None:
        body = {
            "inactiveTopicDeleteMode": mode,
            "maxInactiveDurationSeconds": max_inactive_duration_s,
            "deleteWhileInactive": delete_while_inactive,
        }
        await self.request("POST", f"{_policy_path(target)}/inactiveTopicPolicies", body)

    async def remove_inactive_topic_policies(self, target: str) -> None:
        await self.request("DELETE", f"{_policy_path(target)}/inactiveTopicPolicies")

    async def get_subscription_expiration_time(self, namespace: str) -> int | None:
        """Minutes a durable subscription may go without a consumer (0: forever; None:
        unset, the broker's)."""
        answer = await self.request("GET", _ns_path(namespace) + "/subscriptionExpirationTime")
        return None if answer is None else int(answer)

    async def set_subscription_expiration_time(self, namespace: str, minutes: int) -> None:
        await self.request("POST", _ns_path(namespace) + "/subscriptionExpirationTime", minutes)

    async def remove_subscription_expiration_time(self, namespace: str) -> None:
        await self.request("DELETE", _ns_path(namespace) + "/subscriptionExpirationTime")

    async def get_publish_rate(
        self, target: str, *, applied: bool = False
    ) -> dict[str, int] | None:
        """``{"publishThrottlingRateInMsg", "publishThrottlingRateInByte"}`` of a namespace
        or topic (-1: no limit; None: unset); ``applied``: the rate in force on a topic."""
        query = "?applied=true" if applied else ""
        answer = await self.request("GET", f"{_policy_path(target)}/publishRate{query}")
        return None if answer is None else dict(answer)

    async def set_publish_rate(self, target: str, *, messages: int = -1, size: int = -1) -> None:
        """Messages and payload bytes per second a topic takes (-1: no limit)."""
        body = {"publishThrottlingRateInMsg": messages, "publishThrottlingRateInByte": size}
        await self.request("POST", f"{_policy_path(target)}/publishRate", body)

    async def remove_publish_rate(self, target: str) -> None:
        await self.request("DELETE", f"{_policy_path(target)}/publishRate")

    async def get_dispatch_rate(
        self, target: str, *, subscription: bool = False, applied: bool = False
    ) -> dict[str, Any] | None:
        """``{"dispatchThrottlingRateInMsg", "dispatchThrottlingRateInByte",
        "ratePeriodInSecond", "relativeToPublishRate"}`` of a namespace or topic: the rate
        per topic, or per subscription (-1: no limit; None: unset); ``applied``: the rate in
        force on a topic."""
        query = "?applied=true" if applied else ""
        answer = await self.request("GET", _dispatch_rate_path(target, subscription) + query)
        return None if answer is None else dict(answer)

    async def set_dispatch_rate(
        self,
        target: str,
        *,
        subscription: bool = False,
        messages: int = -1,
        size: int = -1,
        period_s: int = 1,
    ) -> None:
        """Messages and bytes per ``period_s`` a topic's subscriptions are sent in all, or
        each subscription (``subscription``) is sent (-1: no limit)."""
        body = {
            "dispatchThrottlingRateInMsg": messages,
            "dispatchThrottlingRateInByte": size,
            "ratePeriodInSecond": period_s,
            "relativeToPublishRate": False,
        }
        await self.request("POST", _dispatch_rate_path(target, subscription), body)

    async def remove_dispatch_rate(self, target: str, *, subscription: bool = False) -> None:
        await self.request("DELETE", _dispatch_rate_path(target, subscription))

    async def get_subscribe_rate(
        self, target: str, *, applied: bool = False
    ) -> dict[str, int] | None:
        """``{"subscribeThrottlingRatePerConsumer", "ratePeriodInSecond"}`` of a namespace
        or topic (-1: no limit; None: unset); ``applied``: the rate in force on a topic."""
        query = "?applied=true" if applied else ""
        answer = await self.request("GET", f"{_policy_path(target)}/subscribeRate{query}")
        return None if answer is None else dict(answer)

    async def set_subscribe_rate(self, target: str, *, per_consumer: int, period_s: int) -> None:
        """Subscribes one consumer may make to a topic per ``period_s`` (-1: no limit)."""
        body = {"subscribeThrottlingRatePerConsumer": per_consumer, "ratePeriodInSecond": period_s}
        await self.request("POST", f"{_policy_path(target)}/subscribeRate", body)

    async def remove_subscribe_rate(self, target: str) -> None:
        await self.request("DELETE", f"{_policy_path(target)}/subscribeRate")

    # --- topic compaction -----------------------------------------------------------------

    @staticmethod
    def _compaction_path(target: str) -> str:
        """A ``segment://`` name's path, a scalable ``topic://`` name's, else a topic's."""
        if target.startswith("segment://"):
            return _segment_path(target) + "/compaction"
        if target.startswith("topic://"):
            return _scalable_path(target) + "/compaction"
        return _topic_path(target) + "/compaction"

    async def compact(self, target: str) -> None:
        """Start compacting a topic (each partition), a segment, or every segment of a
        scalable topic; 409 (AdminError) while one runs."""
        await self.request("PUT", self._compaction_path(target))

    async def compaction_status(self, target: str) -> dict[str, str]:
        """``{"status": NOT_RUN|RUNNING|SUCCESS|ERROR, "lastError": ...}``."""
        return dict(await self.request("GET", self._compaction_path(target)))

    async def get_compaction_threshold(self, target: str, *, applied: bool = False) -> int | None:
        query = "?applied=true" if applied else ""
        answer = await self.request("GET", _policy_path(target) + "/compactionThreshold" + query)
        return None if answer is None else int(answer)

    async def set_compaction_threshold(self, target: str, threshold_bytes: int) -> None:
        await self.request("POST", _policy_path(target) + "/compactionThreshold", threshold_bytes)

    async def remove_compaction_threshold(self, target: str) -> None:
        await self.request("DELETE", _policy_path(target) + "/compactionThreshold")

    # --- stored messages ------------------------------------------------------------------

    async def peek_messages(
        self, topic: str, subscription: str, count: int = 1
    ) -> list[dict[str, Any]]:
        """The first ``count`` entries of a subscription's backlog, batches split (see
        :func:`anabranch.admin.messages.decode_peeked`)."""
        out: list[dict[str, Any]] = []
        base = f"{_topic_path(topic)}/subscription/{_q(subscription)}/position"
        for n in range(1, count + 1):
            try:
                headers, body = await self.request_raw("GET", f"{base}/{n}")
            except AdminHttpError as err:
                if err.status == 404 and out:
                    break  # fewer messages than asked for
                raise
            out.extend(decode_peeked(headers, body))
        return out

    async def examine_message(
        self, topic: str, initial_position: str = "latest", message_position: int = 1
    ) -> list[dict[str, Any]]:
        """The N-th entry from the earliest or the latest one."""
        query = f"?initialPosition={_q(initial_position)}&messagePosition={int(message_position)}"
        return decode_peeked(
            *await self.request_raw("GET", f"{_topic_path(topic)}/examinemessage{query}")
        )

    async def get_message_by_id(
        self, topic: str, ledger_id: int, entry_id: int
    ) -> list[dict[str, Any]]:
        """The entry at ``ledger_id:entry_id``."""
        path = f"{_topic_path(topic)}/ledger/{int(ledger_id)}/entry/{int(entry_id)}"
        return decode_peeked(*await self.request_raw("GET", path))

    async def expire_messages(self, topic: str, subscription: str, seconds: int) -> None:
        """Acknowledge the subscription's messages older than ``seconds``."""
        path = f"{_topic_path(topic)}/subscription/{_q(subscription)}/expireMessages/{int(seconds)}"
        await self.request("POST", path)

    async def expire_messages_all_subscriptions(self, topic: str, seconds: int) -> None:
        """Expire messages older than ``seconds`` on every subscription of the topic."""
        path = f"{_topic_path(topic)}/all_subscription/expireMessages/{int(seconds)}"
        await self.request("POST", path)

    # --- schemas --------------------------------------------------------------------------

    async def get_schema(self, topic: str, version: int | None = None) -> dict[str, Any]:
        """The latest (or one) version: ``{"version", "type", "timestamp", "data",
        "properties"}``."""
        path, query = _schema_path(topic)
        suffix = "/schema" if version is None else f"/schema/{int(version)}"
        return dict(await self.request("GET", path + suffix + query))

    async def get_all_schemas(self, topic: str) -> list[dict[str, Any]]:
        """Every live version, oldest first."""
        path, query = _schema_path(topic)
        answer = await self.request("GET", path + "/schemas" + query)
        return list(answer["getSchemaResponseList"])

    async def upload_schema(
        self, topic: str, schema_type: str, definition: str = "",
        properties: dict[str, str] | None = None,
    ) -> int:  # fmt: skip
        """Register a schema (checked for compatibility); its version."""
        path, query = _schema_path(topic)
        body = {"type": schema_type, "schema": definition, "properties": properties or {}}
        return int((await self.request("POST", path + "/schema" + query, body))["version"])

    async def delete_schema(self, topic: str, *, force: bool = False) -> int:
        """Delete a topic's schema (``force``: its whole history); the marker's version."""
        path, query = _schema_path(topic)
        query = (query + "&" if query else "?") + f"force={str(force).lower()}"
        return int((await self.request("DELETE", path + "/schema" + query))["version"])

    async def test_schema_compatibility(
        self, topic: str, schema_type: str, definition: str = "",
        properties: dict[str, str] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """``{"isCompatibility": bool, "schemaCompatibilityStrategy": str}``."""
        path, query = _schema_path(topic)
        body = {"type": schema_type, "schema": definition, "properties": properties or {}}
        return dict(await self.request("POST", path + "/compatibility" + query, body))

    async def get_schema_compatibility_strategy(self, target: str) -> str | None:
        """A namespace's strategy (UNDEFINED: the broker's) or a topic's override."""
        answer = await self.request("GET", _policy_path(target) + "/schemaCompatibilityStrategy")
        return None if answer is None else str(answer)

    async def set_schema_compatibility_strategy(self, target: str, strategy: str) -> None:
        await self.request("PUT", _policy_path(target) + "/schemaCompatibilityStrategy", strategy)

    async def remove_schema_compatibility_strategy(self, target: str) -> None:
        await self.request("DELETE", _policy_path(target) + "/schemaCompatibilityStrategy")

    async def get_backlog_quotas(self, target: str) -> dict[str, Any]:
        """``{type: {"limitSize", "limitTime", "policy"}}``."""
        return dict(await self.request("GET", _policy_path(target) + "/backlogQuotaMap"))

    async def set_backlog_quota(
        self,
        target: str,
        *,
        limit_size: int = -1,
        limit_time_s: int = -1,
        policy: str = "producer_request_hold",
        quota_type: str = "destination_storage",
    ) -> None:
        body = {"limitSize": limit_size, "limitTime": limit_time_s, "policy": policy}
        path = f"{_policy_path(target)}/backlogQuota?backlogQuotaType={_q(quota_type)}"
        await self.request("POST", path, body)

    async def remove_backlog_quota(
        self, target: str, quota_type: str = "destination_storage"
    ) -> None:
        path = f"{_policy_path(target)}/backlogQuota?backlogQuotaType={_q(quota_type)}"
        await self.request("DELETE", path)

    # --- topics ---------------------------------------------------------------------------

    async def list_topics(self, namespace: str) -> list[str]:
        """Persistent topics, then the non-persistent ones loaded now (as ``pulsar-admin
        topics list`` shows both)."""
        ns = NamespaceName.parse(namespace)
        path = f"{_q(ns.tenant)}/{_q(ns.namespace)}"
        persistent = list(await self.request("GET", f"/admin/v2/persistent/{path}"))
        return persistent + list(await self.request("GET", f"/admin/v2/non-persistent/{path}"))

    async def list_partitioned_topics(self, namespace: str) -> list[str]:
        ns = NamespaceName.parse(namespace)
        path = f"/admin/v2/persistent/{_q(ns.tenant)}/{_q(ns.namespace)}/partitioned"
        return list(await self.request("GET", path))

    async def create_topic(self, topic: str) -> None:
        await self.request("PUT", _topic_path(topic))

    async def delete_topic(self, topic: str, *, force: bool = False) -> None:
        await self.request("DELETE", _topic_path(topic) + ("?force=true" if force else ""))

    async def create_partitioned_topic(self, topic: str, partitions: int) -> None:
        await self.request("PUT", _topic_path(topic) + "/partitions", partitions)

    async def update_partitioned_topic(self, topic: str, partitions: int) -> None:
        await self.request("POST", _topic_path(topic) + "/partitions", partitions)

    async def get_partitions(self, topic: str) -> int:
        answer = await self.request("GET", _topic_path(topic) + "/partitions")
        return int(answer["partitions"])

    async def delete_partitioned_topic(self, topic: str, *, force: bool = False) -> None:
        suffix = "/partitions" + ("?force=true" if force else "")
        await self.request("DELETE", _topic_path(topic) + suffix)

    async def stats(self, topic: str) -> dict[str, Any]:
        return dict(await self.request("GET", _topic_path(topic) + "/stats"))

    async def partitioned_stats(self, topic: str, *, per_partition: bool = False) -> dict[str, Any]:
        suffix = "/partitioned-stats" + ("?perPartition=true" if per_partition else "")
        return dict(await self.request("GET", _topic_path(topic) + suffix))

    async def internal_stats(self, topic: str) -> dict[str, Any]:
        return dict(await self.request("GET", _topic_path(topic) + "/internalStats"))

    async def terminate(self, topic: str) -> dict[str, Any]:
        return dict(await self.request("POST", _topic_path(topic) + "/terminate"))

    async def offload(self, topic: str, message_id: tuple[int, int]) -> None:
        """Offload the topic's sealed ledgers before ``message_id`` (tiered storage)."""
        body = {"ledgerId": message_id[0], "entryId": message_id[1]}
        await self.request("PUT", _topic_path(topic) + "/offload", body)

    async def offload_status(self, topic: str) -> dict[str, Any]:
        """``{"status", "lastError", "firstUnoffloadedMessage"}`` of the last offload."""
        return dict(await self.request("GET", _topic_path(topic) + "/offload"))

    async def get_offload_value(self, namespace: str, policy: str) -> int | None:
        """``offloadThreshold``, ``offloadThresholdInSeconds`` or ``offloadDeletionLagMs``."""
        answer = await self.request("GET", f"{_ns_path(namespace)}/{policy}")
        return None if answer is None else int(answer)

    async def set_offload_value(self, namespace: str, policy: str, value: int) -> None:
        await self.request("PUT", f"{_ns_path(namespace)}/{policy}", value)

    async def remove_offload_value(self, namespace: str, policy: str) -> None:
        await self.request("DELETE", f"{_ns_path(namespace)}/{policy}")

    async def subscriptions(self, topic: str) -> list[str]:
        return list(await self.request("GET", _topic_path(topic) + "/subscriptions"))

    async def create_subscription(
        self, topic: str, subscription: str, message_id: tuple[int, int] | None = None
    ) -> None:
        """Create a subscription at ``message_id`` (default latest; (-1, -1) is earliest)."""
        body = None
        if message_id is not None:
            body = {"ledgerId": message_id[0], "entryId": message_id[1]}
        await self.request("PUT", self._sub(topic, subscription), body)

    async def delete_subscription(
        self, topic: str, subscription: str, *, force: bool = False
    ) -> None:
        suffix = "?force=true" if force else ""
        await self.request("DELETE", self._sub(topic, subscription) + suffix)

    async def skip_all(self, topic: str, subscription: str) -> None:
        await self.request("POST", self._sub(topic, subscription) + "/skip_all")

    async def skip(self, topic: str, subscription: str, count: int) -> None:
        await self.request("POST", self._sub(topic, subscription) + f"/skip/{count}")

    async def reset_cursor_to_time(self, topic: str, subscription: str, timestamp_ms: int) -> None:
        path = self._sub(topic, subscription) + f"/resetcursor/{timestamp_ms}"
        await self.request("POST", path)

    async def reset_cursor(
        self, topic: str, subscription: str, ledger_id: int, entry_id: int
    ) -> None:
        body = {"ledgerId": ledger_id, "entryId": entry_id}
        await self.request("POST", self._sub(topic, subscription) + "/resetcursor", body)

    @staticmethod
    def _sub(topic: str, subscription: str) -> str:
        return f"{_topic_path(topic)}/subscription/{_q(subscription)}"

    # --- scalable topics (PIP-468); mutations follow a non-leader's 307 to the leader ---------

    async def list_scalable_topics(self, namespace: str) -> list[str]:
        ns = NamespaceName.parse(namespace)
        path = f"/admin/v2/scalable/{_q(ns.tenant)}/{_q(ns.namespace)}"
        return list(await self.request("GET", path))

    async def create_scalable_topic(self, topic: str, num_initial_segments: int = 1) -> None:
        path = _scalable_path(topic) + f"?numInitialSegments={num_initial_segments}"
        await self.request("PUT", path)

    async def get_scalable_topic(self, topic: str) -> dict[str, Any]:
        """The layout JSON (``epoch``, ``nextSegmentId``, ``segments``, ``properties``)."""
        return dict(await self.request("GET", _scalable_path(topic)))

    async def delete_scalable_topic(self, topic: str) -> None:
        await self.request("DELETE", _scalable_path(topic))

    async def scalable_stats(self, topic: str) -> dict[str, Any]:
        """The topic's stats. A non-leader redirects to the controller leader (where the
        assignment states live); if the redirect hops ran out, the leader's
        (``controllerBrokerUrl``) states are fetched from it directly."""
        path = _scalable_path(topic) + "/stats"
        stats = dict(await self.request("GET", path))
        states: dict[str, Any] = stats.get("subscriptionStates") or {}
        leader = stats.get("controllerBrokerUrl")
        if (
            leader
            and leader.rstrip("/") != self.url
            and any(not state.get("leader") for state in states.values())
        ):
            with contextlib.suppress(AdminHttpError, aiohttp.ClientError, TimeoutError):
                there = await self.request("GET", path, base_url=leader)
                stats["subscriptionStates"] = there.get("subscriptionStates", states)
        return stats

    async def scalable_subscriptions(self, topic: str) -> list[str]:
        return list(await self.request("GET", _scalable_path(topic) + "/subscriptions"))

    async def create_scalable_subscription(self, topic: str, subscription: str) -> None:
        path = f"{_scalable_path(topic)}/subscriptions/{_q(subscription)}"
        await self.request("PUT", path)

    async def delete_scalable_subscription(self, topic: str, subscription: str) -> None:
        path = f"{_scalable_path(topic)}/subscriptions/{_q(subscription)}"
        await self.request("DELETE", path)

    async def split_segment(self, topic: str, segment_id: int) -> dict[str, Any]:
        """Split; answers the new layout."""
        return dict(await self.request("POST", f"{_scalable_path(topic)}/split/{segment_id}"))

    async def merge_segments(self, topic: str, first_id: int, second_id: int) -> dict[str, Any]:
        """Merge two adjacent active segments; answers the new layout."""
        path = f"{_scalable_path(topic)}/merge/{first_id}/{second_id}"
        return dict(await self.request("POST", path))

    # ``target`` is a namespace (``tenant/ns``) or a scalable topic (``topic://t/ns/x``).

    async def get_scalable_autoscale(self, target: str, applied: bool = False) -> Any:
        """The level's autoscale overrides (None when unset), or with ``applied`` the
        whole policy in force there (camelCase ``AutoscalePolicy`` fields)."""
        query = "?applied=true" if applied else ""
        return await self.request("GET", _autoscale_path(target) + query)

    async def set_scalable_autoscale(self, target: str, overrides: dict[str, Any]) -> None:
        """Set the level's overrides (what is left out is inherited)."""
        await self.request("POST", _autoscale_path(target), overrides)

    async def remove_scalable_autoscale(self, target: str) -> None:
        await self.request("DELETE", _autoscale_path(target))

    async def create_segment(self, segment: str, subscriptions: list[str] | None = None) -> None:
        await self.request("PUT", _segment_path(segment), list(subscriptions or []))

    async def terminate_segment(self, segment: str) -> dict[str, int]:
        """Seal a segment topic; its dedup snapshot ``{producer: last_sequence_id}``."""
        answer = await self.request("POST", _segment_path(segment) + "/terminate")
        return {str(k): int(v) for k, v in dict(answer).items()}

    async def delete_segment(self, segment: str) -> None:
        await self.request("DELETE", _segment_path(segment))

    # --- transactions (PIP-473 read endpoints) -----------------------------------------------

    async def coordinator_stats(self, coordinator_id: int | None = None) -> dict[str, Any]:
        """Totals plus ``perPartition``; with ``coordinator_id`` that partition's stats."""
        path = f"{TRANSACTIONS}/coordinatorStats{_coordinator_query(coordinator_id)}"
        return dict(await self.request("GET", path))

    async def transaction_metadata(self, most_bits: int, least_bits: int) -> dict[str, Any]:
        """A transaction's header fields and op records (404 when unknown)."""
        path = f"{TRANSACTIONS}/transactionMetadata/{int(most_bits)}/{int(least_bits)}"
        return dict(await self.request("GET", path))

    async def slow_transactions(
        self, timeout_ms: int, coordinator_id: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """OPEN transactions created more than ``timeout_ms`` ago, keyed by txnId."""
        path = f"{TRANSACTIONS}/slowTransactions/{int(timeout_ms)}" + _coordinator_query(
            coordinator_id
        )
        return dict(await self.request("GET", path))

    async def transaction_buffer_stats(self, topic: str) -> dict[str, Any]:
        """The transaction buffer stats of a persistent topic or a ``segment://`` topic."""
        path = f"{TRANSACTIONS}/transactionBufferStats/{_txn_topic_path(topic)}"
        return dict(await self.request("GET", path))

    async def pending_ack_stats(self, topic: str, subscription: str) -> dict[str, Any]:
        """The pending-ack store stats of a subscription (persistent or segment topic)."""
        path = f"{TRANSACTIONS}/pendingAckStats/{_txn_topic_path(topic)}/{_q(subscription)}"
        return dict(await self.request("GET", path))

    # --- batches of an exactly-once sink ----------------------------------------------------

    @staticmethod
    def _batch_path(sink_key: str, batch_id: int) -> str:
        return f"{TRANSACTIONS}/batches/{_q(sink_key)}/{int(batch_id)}"

    async def begin_batch(
        self, sink_key: str, batch_id: int, query_id: str, timeout_ms: int | None = None
    ) -> dict[str, Any]:
        """Get or create the batch's transaction: ``{txnId: {mostSigBits, leastSigBits},
        epoch, state, queryId, winners, ...}``. A COMMITTED answer means the batch is done
        (a replay: skip it); 409 when another queryId committed it."""
        query = f"?queryId={_q(query_id)}"
        if timeout_ms is not None:
            query += f"&timeoutMs={int(timeout_ms)}"
        return dict(await self.request("PUT", self._batch_path(sink_key, batch_id) + query))

    async def commit_batch(
        self, sink_key: str, batch_id: int, query_id: str, epoch: int, winners: list[str]
    ) -> dict[str, Any]:
        """Commit the batch's ``epoch`` keeping only ``winners``' entries (idempotent);
        409 when that epoch was aborted or timed out (replay the batch)."""
        body = {"queryId": query_id, "epoch": int(epoch), "winners": list(winners)}
        path = self._batch_path(sink_key, batch_id) + "/commit"
        return dict(await self.request("POST", path, body))

    async def abort_batch(self, sink_key: str, batch_id: int, epoch: int) -> dict[str, Any]:
        """Abort the batch's ``epoch`` unless it is committed (idempotent)."""
        path = self._batch_path(sink_key, batch_id) + "/abort"
        return dict(await self.request("POST", path, {"epoch": int(epoch)}))

    async def get_batch(self, sink_key: str, batch_id: int) -> dict[str, Any]:
        """The batch and its transaction's state (404 when never begun)."""
        return dict(await self.request("GET", self._batch_path(sink_key, batch_id)))

    # --- transaction keys (the key-fencing PIP) -------------------------------------------

    async def list_transaction_keys(self) -> list[dict[str, Any]]:
        """Every transaction key: owner, transactionKey, epoch, txnId, createdAt, ageMs."""
        return list(await self.request("GET", f"{TRANSACTIONS}/transaction-keys"))

    async def get_transaction_key(self, key: str, *, owner: str = "") -> dict[str, Any]:
        """One key's epoch, transaction (txnId, txnStatus), owner and age (404 unknown)."""
        return dict(await self.request("GET", _key_path(key, owner)))

    async def delete_transaction_key(self, key: str, *, owner: str = "") -> dict[str, Any]:
        """Abort the key's open transaction and delete the key (its holder is fenced)."""
        return dict(await self.request("DELETE", _key_path(key, owner)))

    # --- permissions --------------------------------------------------------------------

    async def namespace_permissions(self, namespace: str) -> dict[str, list[str]]:
        """Role → actions granted on the namespace."""
        return dict(await self.request("GET", _ns_path(namespace) + "/permissions"))

    async def grant_namespace_permission(
        self, namespace: str, role: str, actions: list[str]
    ) -> None:
        """Set ``role``'s actions (``produce``, ``consume``) on the namespace."""
        path = _ns_path(namespace) + f"/permissions/{_q(role)}"
        await self.request("POST", path, list(actions))

    async def revoke_namespace_permission(self, namespace: str, role: str) -> None:
        await self.request("DELETE", _ns_path(namespace) + f"/permissions/{_q(role)}")

    async def permissions(self, topic: str) -> dict[str, list[str]]:
        """Role → actions on a topic (its namespace's grants included)."""
        return dict(await self.request("GET", _permissions_path(topic)))

    async def grant_permission(self, topic: str, role: str, actions: list[str]) -> None:
        """Set ``role``'s actions on one topic (``persistent://`` or scalable ``topic://``)."""
        await self.request("POST", _permissions_path(topic) + f"/{_q(role)}", list(actions))

    async def revoke_permission(self, topic: str, role: str) -> None:
        await self.request("DELETE", _permissions_path(topic) + f"/{_q(role)}")

    # --- misc -----------------------------------------------------------------------------

    async def lookup(self, topic: str) -> dict[str, Any]:
        name = TopicName.parse(topic)
        path = f"/lookup/v2/topic/{name.domain.value}/{name.short_name}"
        return dict(await self.request("GET", path))

    async def health(self) -> str:
        return str(await self.request("GET", "/admin/v2/brokers/health"))

    async def metrics(self) -> str:
        return str(await self.request("GET", "/metrics"))

    async def openapi(self) -> dict[str, Any]:
        return dict(await self.request("GET", "/openapi.json"))
