"""Broker configuration: defaults < config file (TOML) < ``ANABRANCH_*`` env vars < CLI flags.

A cluster broker (``anabranch broker --config FILE``) uses the same settings with an
``etcd://`` metadata URL; ``advertised_address`` is then the host other brokers and
clients reach it at, and ``session_ttl_s`` bounds how long its topics stay unowned after
it dies.

Example:
    >>> cfg = BrokerConfig(data_dir=Path("/tmp/ab"))
    >>> (cfg.port, cfg.http_port, cfg.metadata_url)
    (6650, 8080, 'sqlite:////tmp/ab/metadata.db')
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from anabranch import limits
from anabranch.core.schema_compat import Strategy
from anabranch.errors import InvalidArgument
from anabranch.metadata.etcd_channel import EtcdOptions


class BrokerConfig(BaseSettings):
    """Everything a broker process needs to start."""

    model_config = SettingsConfigDict(env_prefix="ANABRANCH_", extra="forbid")

    cluster_name: str = "standalone"
    data_dir: Path = Path("data")
    metadata_url: str = ""
    """``sqlite:///abs/path``, ``memory://`` or ``etcd://host:port[,host:port]``;
    default: SQLite under ``data_dir``."""
    etcd_username: str | None = None
    etcd_password: SecretStr | None = None
    etcd_tls_trust_certs_file: Path | None = None
    """CA bundle for etcd's server certificates; setting it connects to etcd over TLS."""
    etcd_tls_cert_file: Path | None = None
    """Client certificate (and ``etcd_tls_key_file``) when etcd requires one."""
    etcd_tls_key_file: Path | None = None
    bind_address: str = "127.0.0.1"
    port: int = Field(6650, ge=0, le=65535)
    http_port: int = Field(8080, ge=0, le=65535)
    advertised_address: str = ""
    """Host clients are redirected to; default: ``bind_address``."""
    advertised_port: int | None = Field(None, ge=1, le=65535)
    """Binary-protocol port clients and other brokers are told (a proxy or NAT in front of
    the broker); default: the bound ``port``."""
    advertised_http_port: int | None = Field(None, ge=1, le=65535)
    """HTTP port other brokers and redirected admin clients are told; default: the bound
    ``http_port``."""
    advertised_listeners: str = ""
    """Named listeners (Pulsar's ``advertisedListeners``):
    ``"internal:pulsar://10.0.0.1:6650,external:pulsar+ssl://host:16651"``, or a TOML table
    ``{name = [urls]}``; lookups naming one answer its URLs (``broker.advertised_listeners``)."""
    internal_listener_name: str = ""
    """The listener brokers use among themselves; default: the first one named."""
    fsync: Literal["always", "never"] = "always"
    storage: Literal["file", "jetstream"] = "file"
    """Where ledgers live: local files under ``data_dir`` (standalone's default), or
    replicated NATS JetStream streams (``jetstream_urls``; any broker can take a topic
    over)."""
    jetstream_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``nats://host:port`` (or ``tls://``) of the NATS servers (comma-separated in an env
    var); required with ``storage = "jetstream"``."""
    jetstream_replicas: int = Field(3, ge=1, le=5)
    """Copies of every stream (each acknowledged after fsync on a quorum when the servers
    run with ``sync_interval: always``)."""
    jetstream_stream_prefix: str = Field("ab", pattern=r"^[A-Za-z0-9]{1,32}$")
    """Starts every stream name: clusters sharing one NATS system use distinct prefixes."""
    jetstream_username: str | None = None
    jetstream_password: SecretStr | None = None
    jetstream_token: SecretStr | None = None
    jetstream_credentials_file: Path | None = None
    """A NATS ``.creds`` file (JWT + nkey seed)."""
    jetstream_tls_trust_certs_file: Path | None = None
    """CA bundle for the NATS servers' certificates; setting it connects over TLS."""
    jetstream_tls_cert_file: Path | None = None
    jetstream_tls_key_file: Path | None = None
    max_message_size: int = Field(limits.MESSAGE_SIZE_MAX_BYTES, gt=0)
    """At most ``limits.MESSAGE_SIZE_CAP_BYTES`` (what one storage record holds, less the
    frame padding); a larger value is refused at start."""
    schema_compatibility_strategy: str = "FULL"
    """For namespaces and topics that set none (Pulsar's ``schemaCompatibilityStrategy``):
    ALWAYS_INCOMPATIBLE, ALWAYS_COMPATIBLE, BACKWARD, FORWARD, FULL or a _TRANSITIVE form."""
    schema_versions_max: int = Field(1000, ge=1, le=100_000)
    """Schema versions one topic may hold (delete markers included); past it a new schema
    is refused until the topic's schema is deleted."""
    session_ttl_s: float = Field(10.0, gt=0)
    """TTL of the broker's metadata session: its registry record, topic ownerships and
    controller leaderships die this long after the broker stops refreshing them."""
    load_report_interval_s: float = Field(5.0, gt=0)
    """How often a cluster broker rewrites its registry record with its load."""
    consumer_grace_period_s: float = Field(60.0, ge=0)
    scalable_autoscale_enabled: bool = False
    """Load-driven split and merge of scalable topics by their controller (namespaces and
    topics override it). Off by default: a split seals segments, reroutes producers and
    reassigns consumers, so an operator opts in where traffic really varies."""
    scalable_autoscale_interval_s: float = Field(5.0, gt=0)
    """How often a controller leader samples its segments' load and evaluates the policy."""
    scalable_autoscale_split_msg_rate_in: float = Field(5_000.0, ge=0)
    """A segment splits above this many messages/s in, sustained (0: off)."""
    scalable_autoscale_split_throughput_in: float = Field(5.0 * 1024 * 1024, ge=0)
    """... or above this many bytes/s in (0: off)."""
    scalable_autoscale_split_msg_rate_out: float = Field(0.0, ge=0)
    """... or messages/s out to consumers (0: off)."""
    scalable_autoscale_split_throughput_out: float = Field(0.0, ge=0)
    """... or bytes/s out (0: off)."""
    scalable_autoscale_split_backlog: float = Field(0.0, ge=0)
    """... or its slowest subscription's backlog in messages (0: off)."""
    scalable_autoscale_min_segments: int = Field(1, ge=1)
    scalable_autoscale_max_segments: int = Field(16, ge=1)
    scalable_autoscale_target_segments: int = Field(0, ge=0)
    """The resting size: grown to without load, never merged below (0: none)."""
    scalable_autoscale_merge_low_water: float = Field(0.3, gt=0, lt=1)
    """Two buddies merge when their loads, as fractions of the split thresholds, add up to
    less than this (the hysteresis band lies between it and 1)."""
    scalable_autoscale_split_sustain_s: float = Field(30.0, ge=0)
    scalable_autoscale_merge_sustain_s: float = Field(120.0, ge=0)
    scalable_autoscale_split_cooldown_s: float = Field(60.0, ge=0)
    """A segment is not split until it is this old (a merge's child waits)."""
    scalable_autoscale_merge_cooldown_s: float = Field(300.0, ge=0)
    """A split's children are not merged back until they are this old."""
    scalable_topic_enabled: bool = True
    """Serve scalable (``topic://``) topics (PIP-460's ``scalableTopicEnabled``); a
    namespace policy can switch them off or on for its namespace."""
    cursor_persist_interval_ms: int = Field(200, ge=0, le=60_000)
    """A subscription's acknowledgements are saved at most this often (Pulsar's
    mark-delete rate limit); a crash redelivers what was acknowledged since. Draining a
    sealed segment saves at once whatever this is."""
    allow_auto_topic_creation: bool = True
    policy_cache_enabled: bool = True
    """Read namespace and topic policies and partitioned metadata (what every producer,
    consumer and lookup reads) from memory, kept fresh by a watch of the metadata store
    (``metadata/record_cache.py``). A change made through another broker is seen within
    the watch's delay; off, every such read goes to the store."""
    transactions_enabled: bool = True
    """Serve the transaction coordinator and make every topic a transaction participant
    (Pulsar's ``transactionCoordinatorEnabled``; on by default here)."""
    transaction_partitions: int = Field(16, ge=1, le=1024)
    """Coordinator partitions (TxnID most bits). Persisted by the first broker of a
    metadata store; a broker configured differently refuses to start."""
    use_uvloop: bool = True
    default_retention_time_minutes: int = Field(0, ge=-1)
    """Retention of a namespace without a retention policy (Pulsar's
    ``defaultRetentionTimeInMinutes``; -1 unbounded, 0 none)."""
    default_retention_size_mb: int = Field(0, ge=-1)
    """Pulsar's ``defaultRetentionSizeInMB`` (-1 unbounded, 0 none)."""
    ttl_duration_default_s: int = Field(0, ge=0)
    """Message TTL of a namespace without one (Pulsar's ``ttlDurationDefaultInSeconds``;
    0: off)."""
    retention_check_interval_s: float = Field(120.0, gt=0)
    """How often fully consumed ledgers out of retention are deleted and drained sealed
    segments pruned (Pulsar's ``retentionCheckIntervalInSeconds``)."""
    ttl_check_interval_s: float = Field(60.0, gt=0)
    """How often expired messages are acknowledged (Pulsar's
    ``messageExpiryCheckIntervalInMinutes``, in seconds here)."""
    backlog_quota_check_interval_s: float = Field(60.0, gt=0)
    """How often backlog quotas are checked (``backlogQuotaCheckIntervalInSeconds``)."""
    compaction_check_interval_s: float = Field(60.0, gt=0)
    """How often topics are checked against their compaction threshold (Pulsar's
    ``brokerServiceCompactionMonitorIntervalInSeconds``)."""
    compaction_threshold_default_bytes: int = Field(0, ge=0)
    """Compaction threshold of a namespace without one (Pulsar's
    ``brokerServiceCompactionThresholdInBytes``; 0: no automatic compaction)."""
    compaction_retain_null_key: bool = False
    """Keep messages without a key in the compacted view (Pulsar's
    ``topicCompactionRetainNullKey``)."""
    backlog_quota_default_limit_bytes: int = Field(-1, ge=-1)
    """``destination_storage`` quota of a topic whose namespace sets none (Pulsar's
    ``backlogQuotaDefaultLimitBytes``; -1: none)."""
    backlog_quota_default_limit_second: int = Field(-1, ge=-1)
    """``message_age`` quota of a topic whose namespace sets none (-1: none)."""
    backlog_quota_default_retention_policy: Literal[
        "producer_request_hold", "producer_exception", "consumer_backlog_eviction"
    ] = "producer_request_hold"
    """What the default quotas do (Pulsar's ``backlogQuotaDefaultRetentionPolicy``)."""
    backlog_quota_hold_max_s: float = Field(30.0, gt=0)
    """How long ``producer_request_hold`` holds a send before failing it with
    ProducerBlockedQuotaExceededError."""
    managed_ledger_max_entries_per_ledger: int = Field(50_000, gt=0)
    """A topic's ledger rolls over after this many entries; retention deletes whole
    ledgers (Pulsar's ``managedLedgerMaxEntriesPerLedger``)."""
    managed_ledger_max_ledger_rollover_time_s: float = Field(4 * 3600.0, gt=0)
    """A non-empty ledger older than this rolls over, idle or not (checked at each append
    and each retention sweep; Pulsar's ``managedLedgerMaxLedgerRolloverTimeMinutes``)."""
    managed_ledger_max_size_per_ledger_bytes: int = Field(256 * 1024 * 1024, gt=0)
    """A topic's ledger rolls over after this many bytes (Pulsar's
    ``managedLedgerMaxSizePerLedgerMbytes``, in bytes here)."""
    max_connections: int = Field(limits.BROKER_CONNECTIONS_MAX, gt=0)
    """Client connections at once; one more is refused (TooManyRequests). At most
    ``limits.BROKER_CONNECTIONS_MAX`` (as every cap below: configurable downwards only)."""
    max_connections_per_ip: int = Field(limits.BROKER_CONNECTIONS_PER_IP_MAX, gt=0)
    """Connections from one client address at once (upstream brokerMaxConnectionsPerIp)."""
    max_message_publish_buffer_bytes: int = Field(
        limits.BROKER_PUBLISH_BUFFER_BYTES_MAX, gt=0, le=limits.BROKER_PUBLISH_BUFFER_BYTES_MAX
    )
    """Bytes of unanswered SENDs held over all connections; past it publishing connections
    pause until half is answered (Pulsar's ``maxMessagePublishBufferSizeInMB``, in bytes)."""
    max_topics_per_broker: int = Field(limits.BROKER_TOPICS_MAX, gt=0)
    """Topics loaded at once; loading one more is refused (TooManyRequests)."""
    storage_writer_threads: int = Field(
        limits.STORAGE_WRITER_THREADS, gt=0, le=limits.STORAGE_WRITER_THREADS
    )
    """Writer threads shared by every ledger (group commit); see the limit's docstring."""
    storage_open_files_max: int = Field(
        limits.STORAGE_OPEN_FILES_MAX, gt=0, le=limits.STORAGE_OPEN_FILES_MAX
    )
    """Ledger files held open at once; the least recently used idle one is closed past it."""
    storage_cache_bytes: int = Field(limits.STORAGE_TAIL_CACHE_TOTAL_BYTES, ge=0)
    """Recently written entries kept in memory for tailing readers, over all topics
    (Pulsar's ``managedLedgerCacheSizeMB``, in bytes): past it the entries cached longest
    ago leave, whichever topic holds them (a topic holds at most
    ``STORAGE_TAIL_CACHE_BYTES_MAX`` itself). 0 caches nothing beyond each topic's newest
    write."""
    # Tiered storage (storage/tiered.py, broker/offload.py): sealed ledgers to S3.
    offload_driver: Literal["", "aws-s3", "s3"] = ""
    """``""``: no offload (the offload admin calls answer 409). ``aws-s3``/``s3``: an S3
    bucket (AWS or any S3-compatible server), through obstore (the ``tiered`` extra)."""
    s3_endpoint: str = ""
    """The S3 endpoint URL (``http://host:port`` for a local server; empty: AWS)."""
    s3_bucket: str = ""
    """The bucket offloaded ledgers go to (required with an offload driver)."""
    s3_region: str = "us-east-1"
    s3_access_key_id: str = ""
    s3_secret_access_key: SecretStr | None = None
    offload_deletion_lag_ms: int = Field(4 * 3600 * 1000, ge=-1)
    """How long the hot copy of an offloaded ledger stays (Pulsar's
    ``managedLedgerOffloadDeletionLagMs``; a namespace's ``offloadDeletionLagMs`` wins;
    -1: keep hot copies)."""
    offload_check_interval_s: float = Field(60.0, gt=0)
    """How often namespace offload thresholds and deletion lags are applied, and failed
    offloads retried (at most this long apart; failures back off up to it)."""
    max_topics_per_namespace: int = Field(0, ge=0)
    """Topics a namespace may hold before auto-creation stops (lookups of new names then
    answer NotAllowed and write nothing); 0: no cap (upstream's maxTopicsPerNamespace
    default). At most ``limits.NAMESPACE_TOPICS_MAX``."""
    # Per-topic caps (broker/topic_limits.py); a namespace or topic policy wins. 0: none.
    max_producers_per_topic: int = Field(0, ge=0)
    """Producers one topic (partition, segment) takes; one more gets ProducerBusy."""
    max_consumers_per_topic: int = Field(0, ge=0)
    """Consumers one topic takes over all its subscriptions; one more gets ConsumerBusy."""
    max_consumers_per_subscription: int = Field(0, ge=0)
    """Consumers one subscription takes; one more gets ConsumerBusy."""
    max_subscriptions_per_topic: int = Field(0, ge=0)
    """Subscriptions one topic takes; a new one past it gets NotAllowed."""
    # Dispatch rates (broker/dispatch_throttling.py); a namespace or topic policy wins. 0: none.
    dispatch_throttling_rate_per_topic_in_msg: int = Field(0, ge=0)
    """Messages per second the broker sends a topic's subscriptions in all."""
    dispatch_throttling_rate_per_topic_in_byte: int = Field(0, ge=0)
    """Bytes per second the broker sends a topic's subscriptions in all."""
    dispatch_throttling_rate_per_subscription_in_msg: int = Field(0, ge=0)
    """Messages per second the broker sends one subscription's consumers."""
    dispatch_throttling_rate_per_subscription_in_byte: int = Field(0, ge=0)
    """Bytes per second the broker sends one subscription's consumers."""
    # Subscribe rates (broker/subscribe_throttling.py); a namespace or topic policy wins.
    subscribe_throttling_rate_per_consumer: int = Field(0, ge=0)
    """Subscribes one consumer (client host, name, id) may make to a topic per period; one
    more gets NotAllowed. 0: no limit (upstream's default)."""
    subscribe_rate_period_per_consumer_in_second: int = Field(30, ge=1)
    """The period of ``subscribe_throttling_rate_per_consumer``."""
    max_unacked_messages_per_consumer: int = Field(50_000, ge=0)
    """Unacknowledged messages a Shared or Key_Shared consumer holds before the broker stops
    sending to it, until it is down to half (upstream's default). 0: no cap but
    ``limits.CONSUMER_UNACKED_MESSAGES_MAX``."""
    max_unacked_messages_per_subscription: int = Field(200_000, ge=0)
    """Unacknowledged messages of all the consumers of a Shared or Key_Shared subscription
    before the broker stops reading for it, until they are down to half (upstream's
    default). 0: no cap."""
    # Unused topics deleted (core/inactive_topics.py); a namespace or topic policy wins.
    delete_inactive_topics_enabled: bool = False
    """Delete a topic unused for ``delete_inactive_topics_max_inactive_duration_s``
    (Pulsar's ``brokerDeleteInactiveTopicsEnabled``). Off by default, unlike Pulsar: a
    topic written to without a subscription would lose its data a minute later, which
    neither Kafka nor NATS users expect."""
    delete_inactive_topics_frequency_s: float = Field(60.0, gt=0)
    """How often loaded topics are checked."""
    delete_inactive_topics_mode: Literal[
        "delete_when_no_subscriptions", "delete_when_subscriptions_caught_up"
    ] = "delete_when_no_subscriptions"
    delete_inactive_topics_max_inactive_duration_s: float | None = Field(None, ge=0)
    """How long a topic stays unused before it goes (None: the check frequency)."""
    subscription_expiration_time_minutes: int = Field(0, ge=0)
    """A durable subscription without a consumer for this long is deleted (Pulsar's
    ``subscriptionExpirationTimeMinutes``; 0, the default: never). A namespace's wins."""
    subscription_expiry_check_interval_s: float = Field(300.0, gt=0)
    """How often subscriptions are checked for expiry."""
    max_publish_rate_per_topic_in_messages: int = 0
    """Messages per second one topic takes before its producers' connections are paused
    (Pulsar's ``maxPublishRatePerTopicInMessages``; 0 or less: no limit). A namespace's
    or topic's ``publishRate`` wins."""
    max_publish_rate_per_topic_in_bytes: int = 0
    """The same in payload bytes per second."""
    publish_rate_refresh_interval_s: float = Field(10.0, gt=0)
    """How often loaded topics take up changed publish rates set on another broker (a
    change made through this broker applies at once)."""

    @field_validator(
        "max_connections",
        "max_connections_per_ip",
        "max_topics_per_broker",
        "max_topics_per_namespace",
    )
    @classmethod
    def _only_lower(cls, value: int, info: ValidationInfo) -> int:
        cap = {
            "max_connections": limits.BROKER_CONNECTIONS_MAX,
            "max_connections_per_ip": limits.BROKER_CONNECTIONS_PER_IP_MAX,
            "max_topics_per_broker": limits.BROKER_TOPICS_MAX,
            "max_topics_per_namespace": limits.NAMESPACE_TOPICS_MAX,
        }[str(info.field_name)]
        if value > cap:
            raise ValueError(f"{info.field_name} {value} is over its bound {cap} (limits.py)")
        return value

    idle_ownership_release_s: float = Field(
        limits.CLUSTER_IDLE_OWNERSHIP_RELEASE_S, gt=0, le=limits.CLUSTER_IDLE_OWNERSHIP_RELEASE_S
    )
    """Cluster mode: a topic owned (claimed by a lookup) but not loaded for this long has
    its ownership record deleted."""

    # --- authentication (Pulsar's settings in snake case; docs/security.md) -------------------
    authentication_enabled: bool = False
    """Check every connection's and HTTP request's credentials (Pulsar's
    ``authenticationEnabled``). Off: every client is anonymous (``role`` None) as before."""
    authentication_providers: Annotated[list[Literal["token", "basic", "tls"]], NoDecode] = Field(
        default_factory=list
    )
    """Auth methods accepted, by Pulsar's method names (``AuthenticationProviderToken`` ->
    ``token``, ``AuthenticationProviderBasic`` -> ``basic``, ``AuthenticationProviderTls``
    -> ``tls``)."""
    anonymous_user_role: str | None = None
    """Role of a client that sends no credentials (Pulsar's ``anonymousUserRole``); None:
    such clients are refused."""
    superuser_roles: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Roles allowed everything, including the cluster routes brokers and the controller
    call (Pulsar's ``superUserRoles``; the cluster's own role belongs here)."""
    authorization_enabled: bool = False
    """With authentication on, check every request against the roles' permissions
    (Pulsar's ``authorizationEnabled``, off by default as there): superusers, tenant
    admins, namespace/topic grants (``core/authz.py``). Off, any authenticated role may do
    everything but the cluster calls brokers and the controller make (superusers only)."""
    authenticate_metrics_endpoint: bool = True
    """Whether ``GET /metrics`` needs credentials (Pulsar's ``authenticateMetricsEndpoint``)."""
    token_secret_key: str = ""
    """HS256 key of the token provider: ``file:///path`` (raw bytes, as ``pulsar tokens
    create-secret-key`` writes them) or ``data:;base64,<key>``."""
    token_public_key: str = ""
    """RS256/ES256 public key (DER or PEM) of the token provider, same forms."""
    token_auth_claim: str = "sub"
    """The JWT claim that names the role (Pulsar's ``tokenAuthClaim``)."""
    token_audience: str | None = None
    """When set, tokens must carry this ``aud`` (Pulsar's ``tokenAudience``)."""
    basic_auth_conf: str = ""
    """htpasswd file of the basic provider (bcrypt ``$2y$``, ``$apr1$`` or ``{SHA}``):
    a path, ``file:///path`` or ``data:;base64,<file>`` (Pulsar's ``basicAuthConf``)."""
    auth_refresh_check_s: float = Field(60.0, gt=0)
    """How often a connection's credentials are checked for expiry; an expired token gets
    an AUTH_CHALLENGE, and no valid answer closes the connection (Pulsar's
    ``authenticationRefreshCheckSeconds``)."""

    # --- TLS listeners ------------------------------------------------------------------------
    tls_enabled: bool = False
    """Also serve ``pulsar+ssl://`` on ``broker_service_port_tls`` and HTTPS on
    ``web_service_port_tls``."""
    broker_service_port_tls: int = Field(6651, ge=0, le=65535)
    web_service_port_tls: int = Field(8443, ge=0, le=65535)
    plaintext_enabled: bool = True
    """Serve the plain ``port``/``http_port``; off leaves only the TLS listeners."""
    tls_certificate_file_path: str = ""
    tls_key_file_path: str = ""
    tls_trust_certs_file_path: str = ""
    """CA bundle that client certificates must chain to (TLS authentication)."""
    tls_require_trusted_client_cert_on_connect: bool = False
    """Refuse TLS connections without a trusted client certificate (Pulsar's
    ``tlsRequireTrustedClientCertOnConnect``); off, a certificate is optional but, when
    sent, must be trusted."""
    advertised_port_tls: int | None = Field(None, ge=1, le=65535)
    """TLS binary port clients are told; default: the bound TLS port."""

    # --- credentials this broker presents to other brokers (cluster role) ----------------
    broker_client_auth_token: str = ""
    """Token (or ``file:///path`` holding one) sent to other brokers on wire and HTTP
    calls (Pulsar's ``brokerClientAuthenticationParameters`` with the token plugin)."""
    broker_client_tls_cert_file_path: str = ""
    broker_client_tls_key_file_path: str = ""
    broker_client_trust_certs_file_path: str = ""
    """CA bundle to verify other brokers' TLS certificates with (default: this broker's
    ``tls_trust_certs_file_path``)."""

    @field_validator("authentication_providers", "superuser_roles", "jetstream_urls", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        # Env vars and CLI flags give lists as Pulsar's config does: "token,tls".
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("advertised_listeners", mode="before")
    @classmethod
    def _listener_table(cls, value: Any) -> Any:
        # A TOML table {name = [urls]} is accepted too, kept in Pulsar's string form.
        if isinstance(value, dict):
            from anabranch.broker.advertised_listeners import canonical_spec

            return canonical_spec(value)
        return value

    @field_validator("schema_compatibility_strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        strategy = Strategy.parse(value)  # ValueError names the valid ones
        if strategy is Strategy.UNDEFINED:
            raise ValueError("the broker's schema_compatibility_strategy cannot be UNDEFINED")
        return strategy.value

    @field_validator("max_message_size")
    @classmethod
    def _cap_message_size(cls, value: int) -> int:
        cap = limits.MESSAGE_SIZE_CAP_BYTES
        if value > cap:
            raise ValueError(
                f"max_message_size {value} is over {cap}, the largest message storage accepts"
                f" (a storage record holds at most {limits.STORAGE_RECORD_BYTES_MAX} bytes,"
                f" less {limits.FRAME_PADDING_BYTES} of framing)"
            )
        return value

    @model_validator(mode="after")
    def _fill_defaults(self) -> BrokerConfig:
        if not self.metadata_url:
            self.metadata_url = f"sqlite:///{self.data_dir.resolve() / 'metadata.db'}"
        if not self.advertised_address:
            self.advertised_address = self.bind_address
        if self.storage == "jetstream" and not self.jetstream_urls:
            raise ValueError('storage = "jetstream" needs jetstream_urls')
        if self.offload_driver and not self.s3_bucket:
            raise ValueError("offload_driver needs s3_bucket")
        if self.authentication_enabled and not self.authentication_providers:
            raise ValueError("authentication_enabled needs at least one authentication_provider")
        if self.tls_enabled and not (self.tls_certificate_file_path and self.tls_key_file_path):
            raise ValueError("tls_enabled needs tls_certificate_file_path and tls_key_file_path")
        if not self.plaintext_enabled and not self.tls_enabled:
            raise ValueError("plaintext_enabled=false needs tls_enabled=true")
        from anabranch.broker.advertised_listeners import internal_listener

        try:
            self.internal_listener_name = internal_listener(
                self.advertised_listeners, self.internal_listener_name
            )
        except InvalidArgument as err:
            raise ValueError(str(err)) from err
        return self

    def etcd_options(self) -> EtcdOptions:
        """TLS and credentials for an ``etcd://`` metadata URL."""
        options = EtcdOptions(
            username=self.etcd_username,
            password=None if self.etcd_password is None else self.etcd_password.get_secret_value(),
            tls_trust_certs_file=self.etcd_tls_trust_certs_file,
            tls_cert_file=self.etcd_tls_cert_file,
            tls_key_file=self.etcd_tls_key_file,
        )
        options.check()
        return options

    @classmethod
    def load(cls, path: Path | None = None, **overrides: Any) -> BrokerConfig:
        """Read ``path`` (TOML) if given, then env vars, then ``overrides`` (CLI flags)."""
        values: dict[str, Any] = {}
        if path is not None:
            try:
                values = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as err:
                raise InvalidArgument(f"cannot read config {path}: {err}") from err
            # Keyword arguments beat env vars in pydantic-settings: drop the file's values
            # that an env var sets, so the env var wins as documented.
            values = {k: v for k, v in values.items() if f"ANABRANCH_{k.upper()}" not in os.environ}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
