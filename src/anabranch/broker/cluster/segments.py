"""Segment operations across a cluster: each runs on the broker that owns the segment.

The scalable-topic controller leader creates, seals, seeds and inspects segment topics
through :class:`~anabranch.scalable.segment_ops.SegmentOps`. In a cluster a segment is
owned like any topic, usually by another broker, so :class:`ClusterSegmentOps` asks the
ownership layer where the segment lives (assigning a new one, e.g. a split's child, to the
least-loaded broker) and either runs the operation on this broker's own topics or sends it
to the owner's admin API (``/admin/v2/cluster/segments/{t}/{ns}/{topic}/{descriptor}...``;
the receiver claims the segment if it is still unowned and runs the operation on its own
topics, so a chosen broker never forwards again). Only the owner ever opens a segment's ledger, so
the controller never fences a broker that is serving the segment.

Example (a cluster of one broker: the segment is assigned to it and run here):
    >>> import asyncio, tempfile
    >>> from pathlib import Path
    >>> from anabranch.broker.segment_ops import BrokerSegmentOps
    >>> from anabranch.core.names import HashRange, TopicName
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(ops: ClusterSegmentOps, segment: SegmentName) -> None:
    ...     await ops.create_segment(segment, ["billing"])   # wherever its owner is
    ...     marks = await ops.terminate_segment(segment)
    ...     print(ops.ownership.owned_topics(), marks)
    >>> async def main() -> None:
    ...     topic = TopicName.parse("topic://public/default/orders")
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             service = broker.service
    ...             ownership = ClusterOwnership(broker.node.store, service, cluster="c1",
    ...                                          session_ttl_s=10.0)
    ...             service.ownership = ownership
    ...             await ownership.start(broker.service_url, broker.http_url or "")
    ...             ops = ClusterSegmentOps(BrokerSegmentOps(service), ownership)
    ...             await demo(ops, SegmentName(topic, HashRange(0, 0xFFFF), 0))
    ...             await ops.close()
    ...             await ownership.stop()
    >>> asyncio.run(main())
    ['segment://public/default/orders/0000-ffff-0'] b'{}'
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp

from anabranch import limits
from anabranch.broker.cluster.ownership import ClusterOwnership
from anabranch.core.names import SegmentName
from anabranch.errors import (
    AnabranchError,
    InvalidArgument,
    MetadataUnavailable,
    NotAllowed,
    NotFound,
    NotOwner,
)
from anabranch.scalable.segment_ops import (
    SegmentLoad,
    SegmentOps,
    decode_dedup_snapshot,
    encode_dedup_snapshot,
)

log = logging.getLogger(__name__)

REMOTE_SEGMENT_OP_TIMEOUT_S = 30.0
"""Bound on one segment operation sent to another broker (a seal waits for in-flight
appends; a ledger recovery on first load reads its tail)."""


def segment_path(segment: SegmentName) -> str:
    """The admin path of a segment.

    >>> segment_path(SegmentName.parse("segment://public/default/orders/0000-7fff-1"))
    '/admin/v2/cluster/segments/public/default/orders/0000-7fff-1'
    """
    t = segment.topic
    return (
        f"/admin/v2/cluster/segments/{t.tenant}/{t.namespace}/{t.local_name}/{segment.descriptor}"
    )


class ClusterSegmentOps:
    """:class:`SegmentOps` that runs each operation on the segment's owner."""

    def __init__(self, local: SegmentOps, ownership: ClusterOwnership) -> None:
        self.local = local
        self.ownership = ownership
        self._http: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _owner_http(self, segment: SegmentName) -> str | None:
        """None when this broker owns (or has just claimed) the segment, else the owner's
        (or the chosen broker's) HTTP URL."""
        for _ in range(limits.CLUSTER_CLAIM_ATTEMPTS_MAX):
            answer = await self.ownership.lookup(str(segment))
            if answer.pulsar_url != self.ownership.me.pulsar_url:
                return answer.http_url
            try:
                await self.ownership.claim(str(segment))
                return None
            except NotOwner as err:
                if err.leader_url:
                    return err.leader_url
        raise NotOwner(str(segment), None)

    async def _remote(self, base: str, method: str, path: str, body: Any = None) -> Any:
        if self._http is None:
            timeout = aiohttp.ClientTimeout(total=REMOTE_SEGMENT_OP_TIMEOUT_S)
            self._http = aiohttp.ClientSession(timeout=timeout)
        url = base.rstrip("/") + path
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        credentials = self.ownership.credentials
        kwargs["headers"] = credentials.http_headers()
        tls = credentials.ssl_for(url)
        if tls is not None:
            kwargs["ssl"] = tls
        try:
            async with self._http.request(method, url, **kwargs) as response:
                text = await response.text()
                if response.status >= 300:
                    raise _http_error(response.status, url, text)
                return json.loads(text) if text else None
        except aiohttp.ClientError as err:
            raise MetadataUnavailable(f"segment operation at {url} failed: {err}") from err
        except TimeoutError as err:
            # aiohttp's timeout is no ClientError: an owner that stopped answering (paused,
            # partitioned) must be the same retriable failure as one that refused, not a
            # bare TimeoutError (an admin split answered 500 and logged a traceback).
            raise MetadataUnavailable(
                f"segment operation at {url}: no answer in {REMOTE_SEGMENT_OP_TIMEOUT_S:g}s"
            ) from err

    # --- SegmentOps ---------------------------------------------------------------------------

    async def create_segment(self, segment: SegmentName, subscriptions: list[str]) -> None:
        owner = await self._owner_http(segment)
        if owner is None:
            await self.local.create_segment(segment, subscriptions)
        else:
            await self._remote(owner, "PUT", segment_path(segment), list(subscriptions))

    async def terminate_segment(self, segment: SegmentName) -> bytes:
        owner = await self._owner_http(segment)
        if owner is None:
            return await self.local.terminate_segment(segment)
        marks = await self._remote(owner, "POST", segment_path(segment) + "/terminate")
        return encode_dedup_snapshot({str(k): int(v) for k, v in (marks or {}).items()})

    async def seed_dedup(self, segment: SegmentName, parent_snapshots: list[bytes]) -> None:
        owner = await self._owner_http(segment)
        if owner is None:
            await self.local.seed_dedup(segment, parent_snapshots)
        else:
            body = [decode_dedup_snapshot(s) for s in parent_snapshots]
            await self._remote(owner, "POST", segment_path(segment) + "/seedDedup", body)

    async def segment_subscriptions(self, segment: SegmentName) -> list[str]:
        owner = await self._owner_http(segment)
        if owner is None:
            return await self.local.segment_subscriptions(segment)
        names = await self._remote(owner, "GET", segment_path(segment) + "/subscriptions")
        return sorted(str(n) for n in names or [])

    async def segment_backlog(self, segment: SegmentName, subscription: str) -> int:
        owner = await self._owner_http(segment)
        if owner is None:
            return await self.local.segment_backlog(segment, subscription)
        path = f"{segment_path(segment)}/backlog/{subscription}"
        return int(await self._remote(owner, "GET", path) or 0)

    async def segment_load(self, segment: SegmentName) -> SegmentLoad:
        owner = await self._owner_http(segment)
        if owner is None:
            return await self.local.segment_load(segment)
        return SegmentLoad.from_dict(
            await self._remote(owner, "GET", segment_path(segment) + "/load") or {}
        )

    async def remove_subscription(self, segment: SegmentName, subscription: str) -> None:
        owner = await self._owner_http(segment)
        if owner is None:
            await self.local.remove_subscription(segment, subscription)
        else:
            path = f"{segment_path(segment)}/subscriptions/{subscription}"
            await self._remote(owner, "DELETE", path)

    async def delete_segment(self, segment: SegmentName) -> None:
        owner = await self._owner_http(segment)
        if owner is None:
            await self.local.delete_segment(segment)
        else:
            await self._remote(owner, "DELETE", segment_path(segment))


def _http_error(status: int, url: str, text: str) -> AnabranchError:
    try:
        reason = str(json.loads(text).get("reason", text))
    except (ValueError, AttributeError):
        reason = text
    message = f"{url}: HTTP {status}: {reason}"
    if status == 404:
        return NotFound(message)
    if status == 400:
        return InvalidArgument(message)
    if status in (405, 409):
        return NotAllowed(message)
    return MetadataUnavailable(message)  # 5xx, or a redirect we could not follow: retriable
