"""Topic ownership in a cluster: one owner per topic, bound to the owner's session.

Theory of operation
-------------------
Each broker holds one metadata session (an etcd lease). Under it, it keeps its registry
record (``/brokers/<id>``, rewritten every ``load_report_interval_s`` with its load) and
the ownership record of every topic it owns (:mod:`.records`). Records are created and
taken over only by compare-and-set, so however lookups race, one broker wins each topic.

* **Claim** (:meth:`ClusterOwnership.claim`, called by ``BrokerService.get_topic`` before
  a topic loads): absent record → create it (``MUST_NOT_EXIST``); a ``released`` record
  meant for us (or for anyone, or for a broker that is gone) → CAS on its version; owned
  by another broker → :class:`~anabranch.errors.NotOwner` (ServiceNotReady on the wire,
  307 to the owner over HTTP). Loading then opens the managed ledger for recovery, which
  fences the previous owner's writer (DESIGN.md §4).
* **Lookup** (:meth:`ClusterOwnership.lookup`): an owned topic answers Connect to its
  owner. An unowned topic is assigned to the least-loaded live broker (:mod:`.placement`):
  if that is us we claim it and answer Connect; otherwise Redirect (authoritative) to it,
  and an authoritative lookup always claims locally, so the chosen broker's CAS decides.
  An owner that refuses TCP connections (crashed) is not handed to clients: the lookup
  waits for its record to expire with its session and then assigns the topic, so clients
  do not spend the TTL backing off against a dead address.
* **Nothing for names that do not exist.** Before assigning an unowned topic, a lookup
  checks it exists or would be auto-created (``BrokerService.check_exists``, reads only);
  otherwise it fails with TopicNotFound and writes nothing. A topic claimed by a lookup but
  never loaded (a name looked up and never used) has its record deleted after
  ``idle_release_s`` (:meth:`ClusterOwnership.release_idle`, run with the load reports).
* **Session loss.** A broker stops serving the moment its session's local deadline
  passes (``serving`` is checked on every SEND and every topic load), then closes what it
  owned and opens a new session. The local deadline is counted from *before* the last
  successful keepalive was sent, so it passes before etcd drops the lease and anyone else
  can claim the topics. A broker paused past its TTL (SIGSTOP) wakes with the deadline
  passed; anything it still tries to append fails because the new owner's recovery-open
  fenced the ledger, and any metadata its transaction participants still try to write
  fails on :meth:`ClusterOwnership.fence` (DESIGN.md §2: leadership is never proof of the
  right to write).
* **Unload** (:meth:`ClusterOwnership.unload`): owned → ``releasing`` (stop serving, close
  the topic so its clients reconnect) → ``released`` with a ``target`` broker, which takes
  the topic over by CAS when its clients arrive.

Example (a cluster of one broker, on an in-process broker's service and store):
    >>> import tempfile
    >>> from pathlib import Path
    >>> from anabranch.testing.broker import InProcessBroker
    >>> async def demo(store: MetadataStore, service: BrokerService) -> None:
    ...     ownership = ClusterOwnership(store, service, cluster="c1", session_ttl_s=10.0)
    ...     service.ownership = ownership
    ...     await ownership.start("pulsar://10.0.0.1:6650", "http://10.0.0.1:8080")
    ...     answer = await ownership.lookup("persistent://public/default/t")
    ...     print(answer.pulsar_url, answer.redirect, ownership.owned_topics())
    ...     await ownership.stop()
    ...     print(ownership.owned_topics())
    >>> async def main() -> None:
    ...     with tempfile.TemporaryDirectory() as tmp:
    ...         async with InProcessBroker(Path(tmp)) as broker:
    ...             await demo(broker.node.store, broker.service)
    >>> asyncio.run(main())
    pulsar://10.0.0.1:6650 False ['persistent://public/default/t']
    []
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from anabranch import failpoints, limits
from anabranch.broker.advertised_listeners import parse_listeners, record_form
from anabranch.broker.cluster.placement import broker_load, choose_broker, smoothed_rate
from anabranch.broker.cluster.records import (
    BROKERS_PREFIX,
    OWNERSHIP_PREFIX,
    BrokerRecord,
    OwnerRecord,
    OwnerState,
    broker_path,
    decode_broker,
    decode_owner,
    encode,
    ownership_path,
    topic_of_ownership_path,
)
from anabranch.broker.probe import handshake
from anabranch.core.names import TopicName, parse_name
from anabranch.errors import (
    AnabranchError,
    BadVersion,
    Closed,
    Compacted,
    InvalidArgument,
    MetadataError,
    NotFound,
    NotOwner,
    SessionExpired,
)
from anabranch.metadata.api import MUST_NOT_EXIST, Check, MetadataStore, Record, Session
from anabranch.security.broker_client import BrokerClientCredentials
from anabranch.supervisor import Supervised

if TYPE_CHECKING:
    from anabranch.broker.service import BrokerService

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupAnswer:
    """Where a client should go for a topic.

    ``redirect`` False: connect to ``pulsar_url`` (the owner). True: ask ``pulsar_url``
    again with ``authoritative`` set (it was chosen to own the topic and will claim it).
    """

    pulsar_url: str
    http_url: str
    redirect: bool = False
    pulsar_url_tls: str = ""
    """The broker's ``pulsar+ssl://`` URL, for ``brokerServiceUrlTls`` ("" if none)."""


_NO_CREDENTIALS = BrokerClientCredentials()


@dataclass(frozen=True, slots=True)
class _Claim:
    """What this broker wrote (or found of its own) when it claimed a topic."""

    version: int
    """The record's version: an unload CASes on it."""
    create_revision: int
    """The record's create revision: the fencing token. A new owner after our session
    expired re-creates the (ephemeral) record, so it gets a new one; a handover after an
    unload keeps it, but the unload closed the topic here before releasing it."""


class ClusterOwnership:
    """One broker's session, registry record and topic ownerships (module docstring)."""

    def __init__(
        self,
        store: MetadataStore,
        service: BrokerService,
        *,
        cluster: str,
        session_ttl_s: float,
        load_report_interval_s: float = 5.0,
        connections: Callable[[], int] = lambda: 0,
        idle_release_s: float = limits.CLUSTER_IDLE_OWNERSHIP_RELEASE_S,
    ) -> None:
        self._store = store
        self._service = service
        self.cluster = cluster
        self.session_ttl_s = session_ttl_s
        self.load_report_interval_s = load_report_interval_s
        self._connections = connections
        self._session: Session | None = None
        self._owned: dict[str, _Claim] = {}
        """Topic → our claim on it (its ownership record as we last wrote it)."""
        self._ready = asyncio.Event()
        self._stopping = False
        self._loops: list[Supervised] = []
        self._recent: deque[tuple[float, str]] = deque(maxlen=limits.CLUSTER_RECENT_ASSIGNMENTS_MAX)
        self._rates: tuple[float, int, int] = (time.monotonic(), 0, 0)
        self._reachable_until: dict[str, float] = {}
        self.me = BrokerRecord(broker_id="", pulsar_url="", http_url="", cluster=cluster)
        self.sessions_lost = 0
        """How many times this broker lost its metadata session (each unloads everything)."""
        self.sends_refused = 0
        self.idle_release_s = idle_release_s
        self._idle_since: dict[str, float] = {}
        """Owned topics not loaded here, since when (see :meth:`release_idle`)."""
        self._releasing: dict[str, asyncio.Event] = {}
        self.idle_released = 0
        """Ownership records deleted because their topic was never loaded (or no longer is)."""

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self, pulsar_url: str, http_url: str, pulsar_url_tls: str = "") -> None:
        """Open the session, register this broker and start the guard and load reports."""
        broker_id = pulsar_url.split("://", 1)[-1]
        self.me = BrokerRecord(
            broker_id=broker_id,
            pulsar_url=pulsar_url,
            http_url=http_url,
            cluster=self.cluster,
            pulsar_url_tls=pulsar_url_tls,
            advertised_listeners=self._own_listeners(),
        )
        self._session = await self._store.open_session(self.session_ttl_s)
        await self._register()
        self._ready.set()
        fatal = self._service.fatal.fail
        self._loops = [
            Supervised("cluster-session-guard", self._guard_session, on_give_up=fatal).start(),
            Supervised("cluster-load-report", self._report_load, on_give_up=fatal).start(),
        ]
        log.info("broker %s joined cluster %s", broker_id, self.cluster)

    async def stop(self) -> None:
        """Hand every owned topic back (closing it), deregister and close the session."""
        self._stopping = True
        await asyncio.gather(*(loop.stop() for loop in self._loops))
        owned = list(self._owned)
        self._owned.clear()
        await self._unload_all(owned)
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(AnabranchError):
                await session.close()  # deletes the registry and ownership records

    @property
    def credentials(self) -> BrokerClientCredentials:
        """What this broker presents to other brokers (HTTP calls, probes)."""
        # A service without one (test doubles) presents nothing.
        credentials = getattr(self._service, "broker_client", None)
        return credentials if credentials is not None else _NO_CREDENTIALS

    @property
    def broker_id(self) -> str:
        return self.me.broker_id

    def owned_topics(self) -> list[str]:
        """Topics this broker owns now."""
        return sorted(self._owned)

    # --- the gate BrokerService consults ----------------------------------------------------

    def serving(self, topic: str) -> bool:
        session = self._session
        if topic in self._owned and session is not None and not session.expired:
            return True
        if topic in self._owned and failpoints.enabled(failpoints.STALE_OWNER_SERVES):
            return True
        self.sends_refused += 1
        return False

    def fence(self, topic: str) -> Check:
        """The condition that holds while this claim of ``topic`` does: a write guarded by
        it fails (BadVersion on its path) once another broker re-created the record after
        our session expired. NotOwner if we do not own ``topic``."""
        claim = self._owned.get(topic)
        if claim is None:
            raise NotOwner(topic, None)
        return Check(ownership_path(topic), expected_create_revision=claim.create_revision)

    async def claim(self, topic: str) -> None:
        """Own ``topic`` or raise NotOwner (see the module docstring)."""
        if topic in self._owned and self._alive():
            return
        while (releasing := self._releasing.get(topic)) is not None:
            await releasing.wait()  # an idle release of it is deleting the record
        path = ownership_path(topic)
        for _ in range(limits.CLUSTER_CLAIM_ATTEMPTS_MAX):
            session = await self._live_session(topic)
            record = await self._store.get(path)
            expected = MUST_NOT_EXIST
            if record is not None:
                owner = decode_owner(record.value)
                if self._is_mine(owner, session):
                    self._owned[topic] = _Claim(record.stat.version, record.stat.create_revision)
                    return
                if not await self._may_take(owner):
                    raise _not_owner(topic, owner)
                expected = record.stat.version
            mine = OwnerRecord(
                self.me.broker_id,
                self.me.pulsar_url,
                self.me.http_url,
                session=session.id,
                pulsar_url_tls=self.me.pulsar_url_tls,
            )
            try:
                stat = await self._store.put(path, encode(mine), expected, session=session)
            except BadVersion:
                continue  # someone else moved first: look again
            except SessionExpired:
                raise NotOwner(topic, None) from None
            self._owned[topic] = _Claim(stat.version, stat.create_revision)
            log.info("%s: now owned by %s", topic, self.me.broker_id)
            return
        raise NotOwner(topic, None)

    # --- lookup -----------------------------------------------------------------------------

    def _own_listeners(self) -> dict[str, list[str]]:
        config = getattr(self._service, "config", None)
        spec = getattr(config, "advertised_listeners", "") or ""
        return record_form(parse_listeners(spec))

    async def published_listeners(self, pulsar_url: str) -> dict[str, list[str]]:
        """The advertised listeners the broker known as ``pulsar_url`` publishes in its
        registry record (empty when it has none or is gone).

        Example:
            >>> # await ownership.published_listeners("pulsar://b2:6650") -> {"ext": [...]}
        """
        if pulsar_url == self.me.pulsar_url:
            return self.me.advertised_listeners
        record = await self._store.get(broker_path(pulsar_url.split("://", 1)[-1]))
        if record is None:
            return {}
        return decode_broker(record.value).advertised_listeners

    async def lookup(self, topic: str, *, authoritative: bool = False) -> LookupAnswer:
        """Where ``topic`` is served; assigns an unowned topic (module docstring)."""
        answer = await self._lookup(topic, authoritative)
        if answer.pulsar_url_tls:
            self._learn_tls_url(answer.pulsar_url, answer.pulsar_url_tls)
        return answer

    def _learn_tls_url(self, pulsar_url: str, pulsar_url_tls: str) -> None:
        """Remember a broker's TLS URL for the answers that name only its ``pulsar://``
        URL (the DAG's controller address); bounded like the other per-broker caches."""
        urls = getattr(self._service, "peer_tls_urls", None)
        if urls is None:
            return
        if len(urls) > limits.CLUSTER_RECENT_ASSIGNMENTS_MAX:
            urls.clear()
        urls[pulsar_url] = pulsar_url_tls

    async def _lookup(self, topic: str, authoritative: bool) -> LookupAnswer:
        path = ownership_path(topic)
        for _ in range(limits.CLUSTER_CLAIM_ATTEMPTS_MAX):
            session = await self._live_session(topic)
            record = await self._store.get(path)
            owner = None if record is None else decode_owner(record.value)
            if owner is not None and owner.state is OwnerState.OWNED:
                if self._is_mine(owner, session):
                    return self._my_answer()
                assert record is not None
                if owner.broker_id == self.me.broker_id or not await self._reachable(owner):
                    # Our previous session's record, or a dead owner's: it expires with
                    # that session, so wait for it here rather than send the client away.
                    await self._wait_changed(path, record)
                    continue
                return LookupAnswer(
                    owner.pulsar_url, owner.http_url, pulsar_url_tls=owner.pulsar_url_tls
                )
            if owner is not None and owner.state is OwnerState.RELEASING:
                raise NotOwner(topic, None)
            parsed = parse_name(topic)
            if isinstance(parsed, TopicName) and not self._service.topic_in_use(topic):
                # NotFound (nothing written) when it does not exist and would not be
                # auto-created; a claim for one that would is released if never used.
                await self._service.check_exists(parsed, create=True)
            target = await self._target_for(topic, owner, authoritative)
            if target is not None:
                return LookupAnswer(
                    target.pulsar_url,
                    target.http_url,
                    redirect=True,
                    pulsar_url_tls=target.pulsar_url_tls,
                )
            try:
                await self.claim(topic)
            except NotOwner as err:
                if err.owner_url and err.leader_url:
                    return LookupAnswer(err.owner_url, err.leader_url)
                raise
            return self._my_answer()
        raise NotOwner(topic, None)

    def _my_answer(self) -> LookupAnswer:
        me = self.me
        return LookupAnswer(me.pulsar_url, me.http_url, pulsar_url_tls=me.pulsar_url_tls)

    async def _reachable(self, owner: OwnerRecord) -> bool:
        """Whether the owner answers a CONNECT handshake (cached for a moment).

        A TCP connect is not enough: a paused broker's kernel still accepts connections,
        and so does a proxy or load balancer in front of a dead one; sending clients there
        only makes them back off until the owner's records expire.
        """
        now = time.monotonic()
        if self._reachable_until.get(owner.broker_id, 0.0) > now:
            return True
        host, _, port = owner.pulsar_url.split("://", 1)[-1].rpartition(":")
        credentials = self.credentials
        method, data = credentials.connect_auth()
        try:
            probe = handshake(
                host.strip("[]"),
                int(port),
                ssl_context=credentials.ssl_for(owner.pulsar_url),
                auth_method=method,
                auth_data=data,
            )
            await asyncio.wait_for(probe, limits.CLUSTER_OWNER_PROBE_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError, ConnectionError, AnabranchError):
            log.info("owner %s does not answer: waiting for its records to expire", owner.broker_id)
            return False
        if len(self._reachable_until) > limits.CLUSTER_RECENT_ASSIGNMENTS_MAX:
            self._reachable_until.clear()
        self._reachable_until[owner.broker_id] = now + limits.CLUSTER_OWNER_PROBE_CACHE_S
        return True

    async def _wait_changed(self, path: str, record: Record) -> None:
        """Return once the record at ``path`` changed, or after the session TTL + 1 s."""
        watch = self._store.watch(path, start_revision=record.stat.mod_revision + 1)
        try:
            with contextlib.suppress(TimeoutError, Compacted, StopAsyncIteration):
                await asyncio.wait_for(watch.__anext__(), self.session_ttl_s + 1.0)
        finally:
            await watch.close()

    async def _target_for(
        self, topic: str, owner: OwnerRecord | None, authoritative: bool
    ) -> BrokerRecord | None:
        """The other broker an unowned topic goes to, or None to claim it here."""
        if authoritative:
            return None
        live = {b.broker_id: b for b in await self.live_brokers()}
        if owner is not None and owner.target is not None:
            target = live.get(owner.target)
            return None if target is None or target.broker_id == self.me.broker_id else target
        choice = choose_broker(topic, self._loads(live))
        if choice is None or choice == self.me.broker_id:
            return None
        self._recent.append((time.monotonic(), choice))
        return live[choice]

    def _loads(self, live: dict[str, BrokerRecord]) -> dict[str, float]:
        horizon = time.monotonic() - 2 * self.load_report_interval_s
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        loads = {
            broker_id: broker_load(r.owned_topics, r.msg_rate_long_term)
            for broker_id, r in live.items()
        }
        loads[self.me.broker_id] = broker_load(len(self._owned), self.me.msg_rate_long_term)
        for _, broker_id in self._recent:
            if broker_id in loads:
                loads[broker_id] += 1
        return loads

    async def owner(self, topic: str) -> OwnerRecord | None:
        """The ownership record of ``topic`` (None when unowned)."""
        record = await self._store.get(ownership_path(topic))
        return None if record is None else decode_owner(record.value)

    async def live_brokers(self) -> list[BrokerRecord]:
        """Registered brokers of this cluster, by id."""
        page = await self._store.list_prefix(BROKERS_PREFIX)
        brokers = []
        for record in page.records:
            try:
                broker = decode_broker(record.value)
            except InvalidArgument:
                log.warning("ignoring a bad broker record at %s", record.path)
                continue
            if broker.cluster == self.cluster:
                brokers.append(broker)
                if broker.pulsar_url_tls:
                    self._learn_tls_url(broker.pulsar_url, broker.pulsar_url_tls)
        return sorted(brokers, key=lambda b: b.broker_id)

    async def ownerships(self, prefix: str = "") -> dict[str, OwnerRecord]:
        """Every ownership record whose topic name starts with ``prefix`` (e.g.
        ``persistent://t/ns/``): topic → record."""
        out: dict[str, OwnerRecord] = {}
        start: str | None = None
        path_prefix = (
            OWNERSHIP_PREFIX + prefix.replace("://", "/", 1) if prefix else OWNERSHIP_PREFIX
        )
        while True:
            page = await self._store.list_prefix(path_prefix, start_after=start)
            for record in page.records:
                with contextlib.suppress(InvalidArgument):
                    out[topic_of_ownership_path(record.path)] = decode_owner(record.value)
            if not page.more or not page.records:
                return out
            start = page.records[-1].path

    # --- unload -----------------------------------------------------------------------------

    async def unload(self, topic: str, destination: str | None = None) -> str | None:
        """Stop serving ``topic`` and hand it to ``destination`` (default: the least-loaded
        other live broker; None when there is none). Returns the target broker id.

        NotOwner (307 over HTTP) when another broker owns it; nothing to do when unowned.
        """
        if topic not in self._owned:
            owner = await self.owner(topic)
            if owner is not None and owner.broker_id != self.me.broker_id:
                raise _not_owner(topic, owner)
            await self._service.unload_topic(topic)
            return None
        live = {b.broker_id: b for b in await self.live_brokers()}
        if destination is not None and destination not in live:
            raise InvalidArgument(f"broker {destination} is not a live broker of {self.cluster}")
        if destination is None:
            others = {k: v for k, v in self._loads(live).items() if k != self.me.broker_id}
            destination = choose_broker(topic, others)
        version = self._owned.pop(topic).version  # from here on every SEND is refused
        path = ownership_path(topic)
        session = await self._live_session(topic)
        releasing = OwnerRecord(
            self.me.broker_id,
            self.me.pulsar_url,
            self.me.http_url,
            OwnerState.RELEASING,
            destination,
            session.id,
            self.me.pulsar_url_tls,
        )
        try:
            stat = await self._store.put(path, encode(releasing), version, session=session)
            await self._service.unload_topic(topic)
            if destination is None or destination == self.me.broker_id:
                await self._store.delete(path, stat.version)
            else:
                released = OwnerRecord(
                    self.me.broker_id,
                    self.me.pulsar_url,
                    self.me.http_url,
                    OwnerState.RELEASED,
                    destination,
                    session.id,
                    self.me.pulsar_url_tls,
                )
                await self._store.put(path, encode(released), stat.version, session=session)
        except (BadVersion, SessionExpired) as err:
            log.warning("%s: unload lost the record to another broker (%s)", topic, err)
            await self._service.unload_topic(topic)
        log.info("%s: unloaded from %s towards %s", topic, self.me.broker_id, destination)
        return destination

    # --- internals --------------------------------------------------------------------------

    def _alive(self) -> bool:
        return self._session is not None and not self._session.expired

    def _is_mine(self, owner: OwnerRecord, session: Session) -> bool:
        return (
            owner.broker_id == self.me.broker_id
            and owner.session == session.id
            and owner.state is OwnerState.OWNED
        )

    async def _may_take(self, owner: OwnerRecord) -> bool:
        if owner.state is not OwnerState.RELEASED:
            return False
        if owner.target is None or owner.target == self.me.broker_id:
            return True
        return owner.target not in {b.broker_id for b in await self.live_brokers()}

    async def _live_session(self, topic: str) -> Session:
        if self._stopping:
            raise Closed("the broker is shutting down")
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), self.session_ttl_s)
            except TimeoutError:
                raise NotOwner(topic, None) from None
        session = self._session
        if session is None or session.expired:
            raise NotOwner(topic, None)
        return session

    async def _register(self) -> None:
        session = self._session
        if session is None:
            return
        topics = self._service.loaded_topics()
        now = time.monotonic()
        msg_in = sum(int(getattr(t, "msg_in_counter", 0)) for t in topics)
        msg_out = sum(int(getattr(t, "msg_out_counter", 0)) for t in topics)
        then, last_in, last_out = self._rates
        elapsed = max(now - then, 1e-3)
        self._rates = (now, msg_in, msg_out)
        rate_in = max(0.0, (msg_in - last_in) / elapsed)
        rate_out = max(0.0, (msg_out - last_out) / elapsed)
        long_term = smoothed_rate(
            self.me.msg_rate_long_term,
            rate_in + rate_out,
            elapsed,
            limits.CLUSTER_LOAD_RATE_HORIZON_S,
        )
        self.me = BrokerRecord(
            broker_id=self.me.broker_id,
            pulsar_url=self.me.pulsar_url,
            http_url=self.me.http_url,
            cluster=self.cluster,
            pulsar_url_tls=self.me.pulsar_url_tls,
            advertised_listeners=self.me.advertised_listeners,
            owned_topics=len(self._owned),
            loaded_topics=len(topics),
            connections=self._connections(),
            msg_rate_in=rate_in,
            msg_rate_out=rate_out,
            msg_rate_long_term=long_term,
            reported_ms=int(time.time() * 1000),
        )
        await self._store.put(broker_path(self.me.broker_id), encode(self.me), session=session)

    async def _report_load(self) -> None:
        while True:
            await asyncio.sleep(min(self.load_report_interval_s, self.idle_release_s / 2))
            if not self._ready.is_set():
                continue
            try:
                await self.release_idle()
                if time.monotonic() - self._rates[0] >= self.load_report_interval_s * 0.99:
                    await self._register()
            except (MetadataError, Closed) as err:
                log.warning("load report failed: %s", err)

    async def release_idle(self) -> int:
        """Delete the ownership records of topics owned but not loaded here for
        ``idle_release_s``: a lookup claims a topic before any client creates it, and a
        name looked up and never used must not keep a record (20,000 random lookups would
        leave 20,000). A later lookup claims it again. Segments of scalable topics (their
        controller creates them) are left alone. Returns how many were released.
        """
        now = time.monotonic()
        idle = self._idle_since
        due: list[tuple[str, int]] = []
        for topic, claim in self._owned.items():
            if topic.startswith("segment://"):
                continue  # created by a controller, not by a name a client made up
            if self._service.topic_in_use(topic):
                idle.pop(topic, None)
            elif now - idle.setdefault(topic, now) >= self.idle_release_s:
                due.append((topic, claim.version))
        for topic in [t for t in idle if t not in self._owned]:
            del idle[topic]
        session = self._session
        if not due or session is None:
            return 0
        for topic, _ in due:  # no await since the check: nothing loaded them meanwhile
            del self._owned[topic]
            del idle[topic]
            self._releasing[topic] = asyncio.Event()
        released = 0
        try:
            for topic, version in due:
                try:
                    await self._store.delete(ownership_path(topic), version)
                    released += 1
                except (BadVersion, NotFound):
                    pass  # already changed hands: nothing of ours to delete
                except (MetadataError, Closed) as err:  # it dies with our session anyway
                    log.warning("%s: releasing the idle ownership failed: %s", topic, err)
                finally:
                    self._releasing.pop(topic).set()
        finally:
            for topic, _ in due:
                event = self._releasing.pop(topic, None)
                if event is not None:
                    event.set()
        self.idle_released += released
        log.info("released %d idle topic ownerships", released)
        return released

    async def _guard_session(self) -> None:
        """Stop serving at the session's deadline, then rejoin with a new session."""
        while not self._stopping:
            session = self._session
            # The deadline passes by the clock alone (no event fires when it does): poll.
            while session is not None and not session.expired:  # noqa: ASYNC110
                await asyncio.sleep(limits.CLUSTER_SESSION_POLL_S)
            self.sessions_lost += 1
            self._ready.clear()
            lost = list(self._owned)
            log.warning(
                "broker %s lost its metadata session: unloading %d topics",
                self.me.broker_id,
                len(lost),
            )
            if not failpoints.enabled(failpoints.STALE_OWNER_SERVES):
                self._owned.clear()
                await self._unload_all(lost)
            self._session = await self._reopen_session()
            with contextlib.suppress(MetadataError, Closed):
                await self._register()
            self._ready.set()

    async def _reopen_session(self) -> Session:
        while True:
            try:
                return await self._store.open_session(self.session_ttl_s)
            except (MetadataError, Closed) as err:
                log.warning("cannot open a metadata session yet: %s", err)
                await asyncio.sleep(limits.CLUSTER_SESSION_RETRY_S)

    async def _unload_all(self, topics: list[str]) -> None:
        semaphore = asyncio.Semaphore(limits.CLUSTER_UNLOAD_CONCURRENCY_MAX)

        async def one(topic: str) -> None:
            async with semaphore:
                try:
                    await self._service.unload_topic(topic)
                except Exception as err:  # fenced ledgers etc.: the topic is gone anyway
                    log.warning("%s: closing after ownership loss failed: %s", topic, err)

        await asyncio.gather(*(one(topic) for topic in topics))


def _not_owner(topic: str, owner: OwnerRecord) -> NotOwner:
    if owner.state is OwnerState.OWNED:
        return NotOwner(topic, owner.http_url, owner.pulsar_url)
    return NotOwner(topic, None)
