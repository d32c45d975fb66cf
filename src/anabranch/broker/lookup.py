"""Handlers of the lookup-style requests: PARTITIONED_METADATA, LOOKUP,
GET_TOPICS_OF_NAMESPACE, GET_SCHEMA and GET_OR_CREATE_SCHEMA.

Each answers with its own response type, failures included (the official clients expect
``response=Failed`` / ``error_code`` in these responses rather than a bare ERROR). A
standalone broker owns every topic, so LOOKUP answers Connect to itself, authoritatively.
Answers carry the broker's ``pulsar+ssl://`` URL too (``brokerServiceUrlTls``) when it has
a TLS listener, so ``pulsar+ssl://`` clients follow them.
In cluster mode (``service.ownership`` is a ``ClusterOwnership``) LOOKUP answers Connect
to the topic's owner, or Redirect (authoritative) to the broker chosen for an unowned
topic; that broker claims it when asked authoritatively. PARTITIONED_METADATA is answered
by any broker from the shared metadata store.

Example:
    >>> # a LOOKUP for any valid topic -> LOOKUP_RESPONSE(Connect, "pulsar://host:port")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from anabranch import limits
from anabranch.broker.advertised_listeners import from_record, listener_urls, parse_listeners
from anabranch.broker.cluster.ownership import ClusterOwnership, LookupAnswer
from anabranch.broker.error_codes import client_message, server_error
from anabranch.broker.scalable_commands import topics_hash
from anabranch.broker.service import canonical_topic
from anabranch.core import topic_patterns
from anabranch.core.names import NamespaceName, SegmentName, TopicName
from anabranch.errors import AnabranchError, InvalidArgument, ResourceLimitReached
from anabranch.protocol import commands
from anabranch.protocol._generated import pulsar_api_pb2 as pb

if TYPE_CHECKING:
    from anabranch.broker.session import Session

log = logging.getLogger(__name__)
T = pb.BaseCommand


def _log_unexpected(err: BaseException, what: str) -> None:
    if not isinstance(err, AnabranchError):
        log.error("%s failed unexpectedly", what, exc_info=err)


@contextlib.contextmanager
def lookup_slot(session: Session) -> Iterator[None]:
    """Count one pending lookup of ``session`` (and of its broker) for its duration;
    ResourceLimitReached (TooManyRequests) over ``SESSION_PENDING_LOOKUPS_MAX`` or
    ``BROKER_PENDING_LOOKUPS_MAX``, counted in ``counters.lookups_refused``."""
    service = session.service
    counters = service.counters
    if session.pending_lookups >= limits.SESSION_PENDING_LOOKUPS_MAX:
        counters.lookups_refused += 1
        raise ResourceLimitReached(
            "pending lookups on this connection", limits.SESSION_PENDING_LOOKUPS_MAX
        )
    if counters.pending_lookups >= limits.BROKER_PENDING_LOOKUPS_MAX:
        counters.lookups_refused += 1
        raise ResourceLimitReached(
            "pending lookups on this broker", limits.BROKER_PENDING_LOOKUPS_MAX
        )
    session.pending_lookups += 1
    counters.pending_lookups += 1
    try:
        yield
    finally:
        session.pending_lookups -= 1
        counters.pending_lookups -= 1


async def handle_partitioned_metadata(
    session: Session, cmd: pb.CommandPartitionedTopicMetadata
) -> None:
    try:
        with lookup_slot(session):
            await _partitioned_metadata(session, cmd)
    except Exception as err:
        _log_unexpected(err, "PARTITIONED_METADATA")
        body = pb.CommandPartitionedTopicMetadataResponse(
            request_id=cmd.request_id,
            response=pb.CommandPartitionedTopicMetadataResponse.Failed,
            error=server_error(err),  # type: ignore[arg-type]
            message=client_message(err),
        )
        session.write(
            pb.BaseCommand(type=T.PARTITIONED_METADATA_RESPONSE, partitionMetadataResponse=body)
        )


async def _partitioned_metadata(session: Session, cmd: pb.CommandPartitionedTopicMetadata) -> None:
    name = canonical_topic(cmd.topic)
    if not isinstance(name, TopicName):
        raise InvalidArgument(f"{cmd.topic} cannot be partitioned")
    partitions = await session.service.policies.get_partitions(str(name.base))
    session.write(commands.partitioned_metadata_response(cmd.request_id, partitions))


async def handle_lookup(session: Session, cmd: pb.CommandLookupTopic) -> None:
    try:
        with lookup_slot(session):
            name = str(canonical_topic(cmd.topic))
            listener_name = cmd.advertised_listener_name
            service = session.service
            ownership = service.ownership
            if isinstance(ownership, ClusterOwnership):
                answer = await ownership.lookup(name, authoritative=cmd.authoritative)
                tls = session.service.tls_url_for(answer.pulsar_url)
                if listener_name:
                    published = await ownership.published_listeners(answer.pulsar_url)
                    chosen = listener_urls(from_record(published), listener_name)
                    answer = dataclasses.replace(answer, pulsar_url=chosen.pulsar_url)
                    tls = chosen.pulsar_url_tls
                session.write(_lookup_answer(cmd.request_id, answer, tls))
                return
            url, tls_url = service.advertised_url, service.advertised_url_tls
            if listener_name:
                listeners = parse_listeners(service.config.advertised_listeners)
                chosen = listener_urls(listeners, listener_name)
                url, tls_url = chosen.pulsar_url, chosen.pulsar_url_tls
            session.write(
                commands.lookup_response(cmd.request_id, url, broker_service_url_tls=tls_url)
            )
    except Exception as err:
        _log_unexpected(err, "LOOKUP")
        body = pb.CommandLookupTopicResponse(
            request_id=cmd.request_id,
            response=pb.CommandLookupTopicResponse.Failed,
            error=server_error(err),  # type: ignore[arg-type]
            message=client_message(err),
        )
        session.write(pb.BaseCommand(type=T.LOOKUP_RESPONSE, lookupTopicResponse=body))


def _lookup_answer(request_id: int, answer: LookupAnswer, tls_url: str | None) -> pb.BaseCommand:
    kind = pb.CommandLookupTopicResponse
    body = kind(
        request_id=request_id,
        brokerServiceUrl=answer.pulsar_url,
        response=kind.Redirect if answer.redirect else kind.Connect,
        authoritative=True,
    )
    if tls_url:
        body.brokerServiceUrlTls = tls_url
    return pb.BaseCommand(type=T.LOOKUP_RESPONSE, lookupTopicResponse=body)


async def handle_get_topics_of_namespace(
    session: Session, cmd: pb.CommandGetTopicsOfNamespace
) -> None:
    """GET_TOPICS_OF_NAMESPACE as upstream answers it: the namespace's topics (partitions
    included) of the asked mode; with ``topics_pattern`` only the matching ones and
    ``filtered=true`` (unless the broker will not evaluate the pattern, see
    ``topic_patterns.compile_safely``: then all, ``filtered=false``, and the client filters);
    ``topics_hash`` of what is answered, and ``changed=false`` with no topics when the
    client's ``topics_hash`` is that already."""
    # Errors go through the session's generic ERROR path: upstream answers them so too.
    ns = NamespaceName.parse(cmd.namespace)
    await session.service.policies.namespace_policies(str(ns))
    topics = await namespace_topics(session, ns, cmd.mode)
    filtered = False
    if cmd.HasField("topics_pattern"):
        pattern = topic_patterns.compile_safely(cmd.topics_pattern)
        if pattern is not None:
            topics = topic_patterns.filter_topics(topics, pattern)
            filtered = True
    digest = topics_hash(topics)
    unchanged = cmd.HasField("topics_hash") and cmd.topics_hash == digest
    body = pb.CommandGetTopicsOfNamespaceResponse(
        request_id=cmd.request_id,
        topics=[] if unchanged else topics,
        filtered=filtered,
        topics_hash=digest,
        changed=not unchanged,
    )
    session.write(
        pb.BaseCommand(type=T.GET_TOPICS_OF_NAMESPACE_RESPONSE, getTopicsOfNamespaceResponse=body)
    )


async def namespace_topics(session: Session, ns: NamespaceName, mode: int) -> list[str]:
    """The registered topics of ``ns`` in ``mode`` (a ``CommandGetTopicsOfNamespace.Mode``),
    sorted. Only ``persistent://`` topics are registered; NON_PERSISTENT lists none yet."""
    topics: list[str] = []
    if mode != pb.CommandGetTopicsOfNamespace.NON_PERSISTENT:
        topics = await session.service.policies.list_topics(str(ns))
    return topics


async def handle_get_schema(session: Session, cmd: pb.CommandGetSchema) -> None:
    body = pb.CommandGetSchemaResponse(request_id=cmd.request_id)
    try:
        name = str(canonical_topic(cmd.topic))
        version = cmd.schema_version if cmd.HasField("schema_version") else None
        schema, number = await session.service.schemas.get(name, version)
        body.schema.CopyFrom(schema)
        body.schema_version = number
    except Exception as err:
        _log_unexpected(err, "GET_SCHEMA")
        body.error_code = server_error(err)  # type: ignore[assignment]
        body.error_message = client_message(err)
    session.write(pb.BaseCommand(type=T.GET_SCHEMA_RESPONSE, getSchemaResponse=body))


async def handle_get_or_create_schema(session: Session, cmd: pb.CommandGetOrCreateSchema) -> None:
    body = pb.CommandGetOrCreateSchemaResponse(request_id=cmd.request_id)
    try:
        parsed = canonical_topic(cmd.topic)
        topic = parsed.topic if isinstance(parsed, SegmentName) else parsed
        # Nothing is written for a namespace that does not exist (NotFound).
        await session.service.policies.namespace_policies(f"{topic.tenant}/{topic.namespace}")
        body.schema_version = await session.service.schemas.get_or_create(str(parsed), cmd.schema)
    except Exception as err:
        _log_unexpected(err, "GET_OR_CREATE_SCHEMA")
        body.error_code = server_error(err)  # type: ignore[assignment]
        body.error_message = client_message(err)
    session.write(
        pb.BaseCommand(type=T.GET_OR_CREATE_SCHEMA_RESPONSE, getOrCreateSchemaResponse=body)
    )
