"""Every bound in one place, each with what happens at the bound and why the number.

Names are nouns with units last. Modules import the constant they need; configuration
may lower (never silently raise) a bound.
"""

from __future__ import annotations

# --- metadata store -----------------------------------------------------------------------

METADATA_VALUE_BYTES_MAX = 1024 * 1024
"""A put over this fails with ValueTooLarge. etcd's default request limit is 1.5 MiB."""

METADATA_PATH_BYTES_MAX = 1024
"""Longer paths fail with InvalidArgument; keys are copied into every index and event."""

METADATA_TXN_OPS_MAX = 128
"""Ops in one atomic commit; more fails with InvalidArgument. etcd's --max-txn-ops default."""

METADATA_LIST_LIMIT_MAX = 10_000
"""Largest page a range listing returns; callers page with ``start_after``."""

METADATA_CHANGELOG_REVISIONS_MAX = 100_000
"""Revisions of history the embedded stores keep for watches; older ones are compacted and
a watch that asks for them gets Compacted (like etcd's auto-compaction)."""

METADATA_WATCH_QUEUE_EVENTS_MAX = 10_000
"""Events buffered for one slow watcher; past this the watch is cancelled with Compacted
so the watcher re-lists instead of the store growing without bound."""

METADATA_WRITE_QUEUE_MAX = 10_000
"""Writes queued for the SQLite writer thread, or for an etcd Txn; callers wait for room
(backpressure)."""

METADATA_GROUP_COMMIT_OPS_MAX = 512
"""Writes applied per SQLite transaction; bounds commit latency under load."""

METADATA_CACHE_ENTRIES_MAX = 20_000
"""Records a broker's policy cache keeps (``metadata/record_cache.py``): namespace and
topic policies and partitioned metadata, absent ones included; least recently used go."""

METADATA_CACHE_RETRY_S = 0.5
"""First pause before the policy cache's watch starts again after a failure, doubling up to
8x while it keeps failing (reads go to the store meanwhile)."""

METADATA_SESSION_TTL_MIN_S = 0.2
METADATA_SESSION_TTL_MAX_S = 3600.0
"""Session TTL bounds: shorter is unusable over a real network, longer hides dead brokers."""

SEQUENTIAL_KEY_DIGITS = 20
"""Zero-padding of sequential keys: 2^64 has 20 decimal digits, so order is lexicographic."""

# --- storage (managed ledger) -------------------------------------------------------------

STORAGE_RECORD_BYTES_MAX = 8 * 1024 * 1024
"""Largest record payload; a length field over this is reported as CorruptRecord (never
allocated). Pulsar's default maxMessageSize is 5 MiB; 8 MiB leaves room for batch headers."""

STORAGE_APPEND_QUEUE_ENTRIES_MAX = 16_384
"""Appends queued for one ledger's writer thread; further appends wait (backpressure).
64 group commits of 256 entries: enough to keep the disk busy, small enough to bound memory."""

STORAGE_APPEND_QUEUE_BYTES_MAX = 64 * 1024 * 1024
"""Bytes queued for one ledger's writer thread; further appends wait (backpressure)."""

STORAGE_WRITER_THREADS = 16
"""Writer threads shared by every ledger of a broker (one factory), started on demand: each
takes a ledger with queued appends, writes and fdatasyncs all of them (group commit), and
hands the ledger back; one ledger is on at most one thread at a time, so its appends stay
in order. One ledger needs one thread; many need concurrent fdatasyncs, which the
filesystem merges into shared journal commits: 1 KiB appends spread over 100 ledgers ran
at about 27k/s with 4 threads, 32k/s with 8 and 36k/s with 16, as fast as a thread per
ledger (benchmarks/ledger_append.py --ledgers 100), which cost 1,000 threads per 1,000
topics."""

STORAGE_WRITER_IDLE_S = 10.0
"""A writer thread without work for this long exits (started again on demand)."""

STORAGE_OPEN_FILES_MAX = 4096
"""Ledger files held open at once per broker (the least recently used idle one is closed
and reopened on its next read or write); also at most half the process's soft
RLIMIT_NOFILE, so sockets and the metadata store keep the other half."""

STORAGE_GROUP_COMMIT_BYTES_MAX = 4 * 1024 * 1024
"""Bytes written per write+fdatasync; bounds commit latency to a few ms at ~1 GB/s."""

STORAGE_READ_ENTRIES_MAX = 10_000
"""Entries one ``read`` returns at most; larger requests are clipped (the dispatcher pages)."""

STORAGE_READ_BYTES_MAX = 16 * 1024 * 1024
"""Bytes one ``read`` returns at most (one oversized entry is still returned whole)."""

STORAGE_TAIL_CACHE_BYTES_MAX = 32 * 1024 * 1024
"""Recently appended entries kept in memory per managed ledger so tailing readers never
touch the disk; the oldest are evicted past this."""

STORAGE_TAIL_CACHE_TOTAL_BYTES = 64 * 1024 * 1024
"""What the tail caches of all of a broker's ledgers hold together, by default (the
broker's ``storage_cache_bytes``, Pulsar's ``managedLedgerCacheSizeMB``); past it the
batches cached longest ago leave, whichever topic holds them."""

CURSOR_ACK_RANGES_PERSIST_MAX = 10_000
"""Individually-acked ranges persisted per cursor (Pulsar's
managedLedgerMaxUnackedRangesToPersist); ranges past it are redelivered after a restart."""

CURSOR_BATCH_ACKS_PERSIST_MAX = 10_000
"""Partially acked batch entries persisted per cursor; past it, batch-index acks of the
newest entries are lost on restart (redelivery, never loss)."""

CURSOR_STATE_BYTES_MAX = 512 * 1024
"""Bytes of one persisted cursor value, at most: the ranges and batch bitsets nearest
mark-delete that fit are kept, later ones are redelivered after a restart (never loss;
``AckState.to_bytes``). 10,000 ranges take 240 KB, but 10,000 partial batches of 1,000
messages would take 1.4 MB: half of METADATA_VALUE_BYTES_MAX keeps every cursor write
(with its check) well inside etcd's 1.5 MiB request."""

DEDUP_SNAPSHOT_BYTES_MAX = 512 * 1024
"""Bytes of the producers map of one dedup snapshot (JSON), at most: the most recently
persisted producers that fit are written, older ones are left out (after a restart a retry
of theirs is taken as new: the same as upstream once a producer is purged as inactive).
Producer names are client-chosen, so only bytes bound the record."""

DEDUP_PRODUCERS_MAX = 10_000
"""Producers one topic's dedup state remembers; a new one past it evicts the least
recently persisted (upstream's brokerDeduplicationMaxNumberOfProducers default)."""

# --- etcd backend ---------------------------------------------------------------------------

ETCD_REQUEST_TIMEOUT_S = 10.0
"""Deadline of one etcd RPC; past it the call fails with MetadataUnavailable (the write may
or may not have happened). Covers an etcd leader election (about 1 s) with room to spare."""

ETCD_REQUEST_BYTES_MAX = 1536 * 1024
"""A commit whose encoded request is larger fails with ValueTooLarge before it is sent.
etcd's --max-request-bytes default (1.5 MiB); the server would reject it anyway."""

ETCD_RESPONSE_BYTES_MAX = 256 * 1024 * 1024
"""Largest gRPC message the client accepts (a listing page of big values); gRPC's 4 MiB
default would fail a page of a few 1 MiB values. Pages are bounded by METADATA_LIST_LIMIT_MAX."""

ETCD_COMMITS_IN_FLIGHT_MAX = 2
"""etcd Txns of commits one store has outstanding; commits arriving meanwhile wait and
leave together in the next one (``metadata/etcd_coalesce.py``): fewer, fuller gRPC calls."""

ETCD_COMMIT_SLOW_S = 0.05
"""A Txn out longer than this stops counting towards ETCD_COMMITS_IN_FLIGHT_MAX (a healthy
one takes a few ms even at concurrency 64), so commits never queue for long behind Txns
stuck on a cut connection."""

ETCD_RECONNECT_WINDOW_S = 30.0
"""How long a watch keeps re-opening its stream after the connection drops before raising
MetadataUnavailable (retriable; iterating again retries). Covers an etcd restart."""

ETCD_RECONNECT_BACKOFF_MIN_S = 0.05
ETCD_RECONNECT_BACKOFF_MAX_S = 1.0
"""Backoff between watch re-open attempts (doubles from min to max); also gRPC's own
reconnect backoff, whose default of up to 120 s would hold a restarted etcd unreachable."""

ETCD_SEQUENTIAL_ATTEMPTS_MAX = 1000
"""CAS attempts of create_sequential on one counter before MetadataUnavailable; each failed
attempt means another creator succeeded, so this only trips under extreme contention."""

# --- wire protocol ------------------------------------------------------------------------

MESSAGE_SIZE_MAX_BYTES = 5 * 1024 * 1024
"""Largest message (metadata + payload) a broker accepts; larger sends get MessageTooBig.
Upstream's ``maxMessageSize`` default (5242880), advertised in CONNECTED."""

FRAME_PADDING_BYTES = 10 * 1024
"""Room for the command and headers around a maximal message (upstream's frame padding)."""

MESSAGE_SIZE_CAP_BYTES = STORAGE_RECORD_BYTES_MAX - FRAME_PADDING_BYTES
"""The largest ``max_message_size`` a broker may be configured with: a frame of such a
message (at most that + ``FRAME_PADDING_BYTES``) still fits one storage record, so a
message the broker accepts is never refused by storage (8 MiB - 10 KiB = 8378368)."""

FRAME_SIZE_MAX_BYTES = MESSAGE_SIZE_MAX_BYTES + FRAME_PADDING_BYTES
"""Largest whole frame on the wire, length prefix included. A longer length prefix closes
the connection before anything is allocated for it (upstream: maxMessageSize + 10 KiB)."""

BATCH_MESSAGES_MAX = 100_000
"""Messages a batch payload may declare; more is InvalidMessage. Every entry costs a Python
object, and 5 MiB of minimal entries (~50 bytes each) stays below this."""

KEEPALIVE_INTERVAL_S = 30.0
"""Silence after which a PING is due, and then how long a PONG may take before the
connection is idle-timed-out (upstream keepAliveIntervalSeconds default on both sides)."""

HANDSHAKE_TIMEOUT_S = 30.0
"""A connection without a completed CONNECT/CONNECTED exchange after this is closed
(upstream closes at the first keepalive tick without a handshake)."""

HANDSHAKE_FRAME_SIZE_MAX_BYTES = 64 * 1024
"""Largest frame a broker reads before it has answered CONNECTED to an authenticated (or,
with authentication off, any) client: a CONNECT, its credentials, AUTH_RESPONSE. Tokens
and passwords are a few KiB; the full frame size (5 MiB) let a client that never
authenticates hold 5 MiB of partial frame per connection (100 connections: +500 MB)."""

PASSWORD_CHECK_THREADS = 2
"""Threads hashing passwords (bcrypt, ``$apr1$``) for the basic provider; their own, so a
flood of wrong passwords never queues in front of storage's threads (300 wrong-password
CONNECTs delayed a producer's topic open by 13 s)."""

PASSWORD_CHECKS_PENDING_MAX = 64
"""Password checks waiting or running per broker; one more is refused with
AuthenticationError at once rather than queued (a check costs tens of milliseconds of
CPU: this bounds a new client's wait to a few seconds whatever the flood)."""

# --- broker connections -------------------------------------------------------------------

SESSION_PENDING_APPENDS_MAX = 10_000
"""SENDs of one connection being appended, at most: at the bound the broker handles no
more of that connection's commands and stops reading its socket until half of them
complete (backpressure on a producer outrunning the disk). Upstream's
maxPendingPublishRequestsPerConnection is 1000 messages; ours counts entries (batches)."""

BROKER_PUBLISH_BUFFER_BYTES_MAX = 256 * 1024 * 1024
"""Bytes of SENDs handled and not yet answered, over every connection of a broker
(``max_message_publish_buffer_bytes`` may lower it; upstream's
maxMessagePublishBufferSizeInMB): past it connections with sends in flight stop being
read until half of it is answered (``broker/publish_buffer.py``). SESSION_PENDING_APPENDS_MAX
bounds those sends in number only: 10,000 of 5 MiB per connection while the disk is full."""

SESSION_OUTPUT_BYTES_MAX = 4 * 1024 * 1024
"""Unsent bytes queued on one connection's socket (transport high-water mark); past it the
broker stops reading from that client until the buffer drains below a quarter of this.
A client that never reads thus stops costing memory instead of growing the buffer."""

SESSION_COMMAND_QUEUE_MAX = 1_000
"""Decoded commands waiting for one connection's handler; past it reading pauses."""

SESSION_TIMER_INTERVAL_S = 1.0
"""How often the server checks handshake and keepalive deadlines of its connections."""

DEDUP_SNAPSHOT_INTERVAL_ENTRIES = 1_000
"""Appends between persisted dedup snapshots of a topic; a restart replays at most about
this many entries' metadata to rebuild the state (upstream's
brokerDeduplicationEntriesInterval default)."""

# --- client -------------------------------------------------------------------------------

CLIENT_RECONNECT_BACKOFF_MIN_S = 0.1
CLIENT_RECONNECT_BACKOFF_MAX_S = 30.0
"""Reconnect delays of producers/consumers double from min to max (jittered down by up to
10%), so a restarting broker is retried quickly and a dead one costs one try per 30 s
(upstream's initial 100 ms and max 30 s)."""

CLIENT_OPERATION_TIMEOUT_S = 30.0
"""A request (lookup, subscribe, seek...) without an answer after this fails with
OperationTimeout (upstream operationTimeoutSeconds default)."""

CLIENT_OPERATION_STUCK_S = 1.5
"""A SEND without its receipt, or a request without its answer, for this long makes the
client probe its connection (a PING that must be answered within CLIENT_PROBE_TIMEOUT_S);
a connection that fails the probe is closed, and its producers and consumers look their
topics up again through another broker and resend (dedup keeps resent messages once). A
paused or partitioned broker keeps TCP open and answers nothing, so without this a client
waits for the keepalive (a minute). A healthy broker answers a PING even while its disk is
slow, so a short bound costs one PING per stuck interval, never a reconnect; together with
the probe it stays under a cluster's session TTL (3-10 s), so the client is ready to move
by the time the topic has. A new connection's handshake gets this plus the probe timeout."""

CLIENT_PROBE_TIMEOUT_S = 1.0
"""How long a probed connection may take to answer (PONG or anything else) before it is
closed as unresponsive; also the handshake timeout of a new connection to a broker that
failed a probe or a handshake (a paused broker's kernel still accepts TCP connections),
until it answers one again. A loaded broker answers a PING in milliseconds; a second is
100x that."""

CLIENT_LOOKUP_REDIRECTS_MAX = 20
"""Lookup redirects followed before LookupFailed (upstream maxLookupRedirects default)."""

SCALABLE_ROUTE_CACHE_MAX = 10_000
"""Keys whose segment a scalable producer remembers under the current DAG (cleared when
the DAG changes or the cache is full)."""

SCALABLE_PRODUCER_REROUTE_WAIT_S = 30.0
"""How long a scalable-topic producer waits, after a segment answered TopicTerminated, for
the DAG that shows the segment sealed (and for its in-flight sends to settle) before it
fails the held messages with that error. A split or merge publishes its DAG within
milliseconds; 30 s (the operation timeout) covers a controller fail-over and a DAG-watch
reconnect, while upstream's 10 retries of up to 500 ms would give up after about 4.5 s."""

STREAM_CONSUMER_RESUBSCRIBE_MAX_S = 2.0
"""Longest pause between a stream consumer's attempts to attach to a newly assigned segment
whose previous owner still holds it (Exclusive answers ConsumerBusy until that consumer
acts on its own assignment update); attempts go on while the segment stays assigned."""

SCALABLE_ASSIGNMENT_REFRESH_S = 5.0
"""How long a stream or checkpoint consumer waits, once its DAG watch shows a layout epoch
above its last assignment's, for an assignment update from the controller (a live leader
pushes one to every consumer within milliseconds of each layout change) before it
registers again, through another broker if it can. This is what moves a consumer off a
controller that lost its leadership without dropping the connection (a paused or
partitioned old leader); a spurious renewal costs one SUBSCRIBE and keeps the share."""

SCALABLE_REGISTRATION_KEEPALIVE_S = 5.0
"""Keepalive interval of a consumer's controller connection (upstream's 30 s for data
connections): a PING after this much silence, the connection closed when no PONG follows
within as long, and a connect or handshake bounded by it too. A frozen controller is thus
left after about twice this, and the consumer registers again elsewhere."""

PRODUCER_PENDING_MESSAGES_MAX = 1000
"""Messages sent but not yet acknowledged by the broker, per producer; further sends wait
for room (or fail with ProducerQueueFull). Upstream maxPendingMessages default."""

PRODUCER_BATCH_MESSAGES_MAX = 1000
PRODUCER_BATCH_BYTES_MAX = 128 * 1024
PRODUCER_BATCH_DELAY_S = 0.01
"""A batch is sent when it holds this many messages or bytes, or this long after its first
message (upstream batchingMaxMessages / batchingMaxBytes / batchingMaxPublishDelay)."""

CONSUMER_RECEIVER_QUEUE_MESSAGES = 1000
"""Messages a consumer may hold undelivered; it grants the broker this many FLOW permits
and refills them when half are consumed (upstream receiverQueueSize default)."""

# --- broker dispatch (subscriptions) --------------------------------------------------------

DISPATCH_READ_ENTRIES_MAX = 100
"""Entries one dispatcher read asks the ledger for; more permits just mean more reads.
Upstream's dispatcherMaxReadBatchSize default."""

DISPATCH_READ_RETRY_MIN_S = 0.1
"""First wait before a dispatch pass whose read failed runs again; doubles per failure in
a row. Upstream's dispatcher readFailureBackoff does the same (it starts at 1 s since
apache/pulsar#12444, 15 s before); a local file or JetStream hiccup heals sooner."""

DISPATCH_READ_RETRY_MAX_S = 15.0
"""Longest wait between retries of a failing dispatch read (a broken storage is tried
four times a minute, not in a busy loop)."""

DISPATCH_CHUNKED_MESSAGES_MAX = 10_000
"""Chunked messages a Shared subscription tracks mid-delivery (which consumer has their
first chunks); past it the oldest is forgotten and its remaining chunks go round-robin."""

DISPATCH_REPLAY_ENTRIES_MAX = 10_000
"""Positions a Shared/Key_Shared subscription holds for redelivery (nacked, from closed
consumers, or Key_Shared entries whose key is busy elsewhere); while over this, no new
entries are read, so a stuck key cannot make the broker buffer the whole backlog."""

DISPATCH_DELAYED_ENTRIES_MAX = 100_000
"""Delayed-delivery positions a Shared subscription holds in memory until due; past it
reading pauses until some come due (upstream keeps them in an in-memory tracker too)."""

SUBSCRIBE_RATE_CONSUMERS_MAX = 10_000
"""Consumers one topic's subscribe rate limiter tracks (the least recently seen are
forgotten past it, which only ever lets a forgotten consumer subscribe sooner)."""

CONSUMER_UNACKED_MESSAGES_MAX = 1_000_000
"""Unacknowledged messages one Shared/Key_Shared consumer may hold whatever its policy says
(``max_unacked_messages_per_consumer`` 0 included: upstream's "no cap"): the broker keeps
a pending record per unacknowledged entry, so this bounds what one consumer costs it."""

# --- admin: policies, HTTP ----------------------------------------------------------------

POLICIES_CAS_RETRIES_MAX = 16
"""Read-modify-CAS attempts of one admin update before it gives up with BadVersion (409):
enough for a handful of concurrent admins, small enough that a hot record cannot spin."""

PARTITIONS_PER_TOPIC_MAX = 10_000
"""Largest partition count; more is InvalidArgument (400). Every partition is a topic with
its own ledger, so this bounds one admin call's load (upstream's
maxNumPartitionsPerPartitionedTopic is unbounded by default)."""

ADMIN_STATS_REDIRECTS_MAX = 3
"""307 hops a scalable topic's ``/stats`` takes towards its controller leader (counted in
``?redirects=``); past it a broker answers what it knows itself. One hop suffices while the
brokers agree on the leader; the bound stops a ping-pong while they do not."""

ADMIN_REQUEST_BODY_BYTES_MAX = 1024 * 1024
"""Largest admin HTTP request body; aiohttp answers 413 past it. Policies and tenant
records are a few hundred bytes; this matches METADATA_VALUE_BYTES_MAX."""

ADMIN_HTTP_CONNECTIONS_MAX = 1024
"""Admin HTTP connections open at once; one past it is closed on arrival. With
BROKER_CONNECTIONS_MAX it keeps the sockets a client can hold under the process's file
limit (admin tools open a few connections each)."""

ADMIN_HTTP_CONNECTIONS_PER_IP_MAX = 256
"""Admin HTTP connections open at once from one client address; one past it is closed on
arrival. A quarter of ADMIN_HTTP_CONNECTIONS_MAX, so one client cannot hold the whole
admin API (the brokers of one machine share an address: each keeps a pool of at most 100
to another)."""

ADMIN_HTTP_IDLE_TIMEOUT_S = 30.0
"""An admin HTTP connection that has not sent a complete request head this long after it
opened, or after its last answer, is closed (a slow or silent client cannot hold it).
Longer than aiohttp clients keep an idle connection (15 s), so ours never reuse one the
server is closing; Jetty's default idle timeout is also 30 s."""

ADMIN_REQUEST_BODY_TIMEOUT_S = 30.0
"""Time an admin request's body has to arrive in full (at most
ADMIN_REQUEST_BODY_BYTES_MAX); past it the request gets 400."""

# --- scalable topics (controller) ---------------------------------------------------------

SCALABLE_CONSUMER_GRACE_PERIOD_MS = 60_000
"""How long a disconnected stream consumer keeps its segments before they are dealt to the
others (PIP-468's default grace period): long enough for a client restart or a broker
failover, short enough that a dead consumer's segments do not stall for minutes."""

SCALABLE_DRAIN_POLL_INTERVAL_S = 1.0
"""How often the controller re-reads the backlog of sealed, undrained segments; children of
a split wait for it, so a drained parent hands over within about this long."""

SCALABLE_INITIAL_SEGMENTS_MAX = 1024
"""Segments a scalable topic may be created with (each is a topic with its own ledger;
splits can add more later). The hash space would allow 65536, taking minutes and
gigabytes to create."""

SCALABLE_SEGMENTS_MAX = 2048
"""Segments, active and sealed, one scalable topic's layout may hold; a split or merge
that would go over is refused (ResourceLimitReached) before anything is sealed. Sealed
segments stay until retention prunes them, so split/merge cycles alone grew the layout
without bound, and a layout over METADATA_VALUE_BYTES_MAX (about 5,000 segments) could not
be written at all. A segment takes about 210-260 bytes of layout JSON: this keeps the
layout near half of that limit."""

SCALABLE_AUTOSCALE_SAMPLES_MAX = 256
"""Rate samples the autoscaler keeps per active segment: at the default 5 s interval,
about 21 minutes, more than the default merge window; bounds its memory per topic."""

SCALABLE_WATCH_RETRY_S = 0.5
"""Pause before a layout watch or election loop retries after an unexpected store error,
so a failing store is not hammered in a tight loop."""

SCALABLE_SESSION_TTL_S = 10.0
"""TTL of the metadata session that holds a broker's controller leaderships when the
service opens its own: a dead broker's topics get a new leader within about this long."""

SCALABLE_SESSION_POLL_S = 0.1
"""How often the controllers' session guard looks at the session's deadline; a broker
notices its expiry (and campaigns again under a new session) at most this late."""

SCALABLE_SESSION_RETRY_S = 0.5
"""Pause between attempts to open a new controller session while the store is down."""

SCALABLE_PENDING_RETRY_MIN_S = 0.5
SCALABLE_PENDING_RETRY_MAX_S = 5.0
"""Backoff of the leader's retries of a split or merge whose segment operation failed (a
dead segment owner is replaced after its session TTL): doubling from the first to the
second, forever while it leads, because the topic takes no other change until it is done."""


SCALABLE_DAG_RESOLVE_S = 2.0
"""How long building a DAG update waits for one segment's owner; past it the segment goes
out without a broker URL (a hint: clients look segments up themselves), so a segment
stuck between owners never holds back the layout itself."""

SCALABLE_WATCH_SESSIONS_PER_CONNECTION_MAX = 1_000
"""DAG-watch sessions (SCALABLE_TOPIC_LOOKUP) one connection may hold: a client watches
each scalable topic it produces to or consumes once; each session costs a pump task and a
listener, so a runaway client cannot grow them without bound (TooManyRequests past it)."""

SCALABLE_CONSUMERS_PER_CONNECTION_MAX = 1_000
"""Stream/checkpoint consumers (SCALABLE_TOPIC_SUBSCRIBE) registered through one
connection; past it the subscribe answers TooManyRequests."""

# --- cluster mode (ownership, lookup, broker registry) --------------------------------------

CLUSTER_CLAIM_ATTEMPTS_MAX = 8
"""Read-then-CAS attempts of one lookup or topic claim before it answers ServiceNotReady:
each failed CAS means another broker just changed the ownership record, so a few rounds
settle any race between brokers; more would only spin on a flapping record."""

CLUSTER_SESSION_POLL_S = 0.1
"""How often a broker compares the clock with its metadata session's deadline; it stops
serving owned topics at most this long after the deadline (well before etcd, which counts
the TTL from a later instant, lets another broker take them)."""

CLUSTER_SESSION_RETRY_S = 0.5
"""Pause between attempts to open a new metadata session after losing one."""

CLUSTER_RECENT_ASSIGNMENTS_MAX = 10_000
"""Assignments a broker remembers between two load reports (so a burst of lookups does
not send every new topic to the same least-loaded broker); older ones are dropped."""

CLUSTER_PLACEMENT_MSGS_PER_TOPIC = 1000.0
"""Placement weighs a broker's reported message rate (in + out) against its topic count:
this many msgs/s count as much as one more owned topic. Idle clusters place by topic count;
a broker carrying hot topics gets new ones only once the others hold that much more."""

CLUSTER_LOAD_RATE_HORIZON_S = 60.0
"""Time constant of the long-term message rate a broker reports for placement."""

CLUSTER_IDLE_OWNERSHIP_RELEASE_S = 60.0
"""An ownership record of a topic this broker owns but has not loaded for this long (a
lookup claimed it and no producer or consumer came) is deleted, so looking up many names
leaves no records behind (``BrokerConfig.idle_ownership_release_s`` may lower it)."""

CLUSTER_UNLOAD_CONCURRENCY_MAX = 64
"""Topics closed at once when a broker loses its session or unloads a namespace."""

BROKER_PROBE_READ_BYTES = 64 * 1024
"""Bytes read per chunk while a liveness probe waits for a broker's CONNECTED."""

CLUSTER_OWNER_PROBE_TIMEOUT_S = 0.5
"""A lookup that finds a topic owned by another broker first completes a CONNECT handshake
with it; refused or not answered within this long (a paused broker's kernel still accepts
TCP, as does a proxy in front of a dead one), the owner is taken for dead and the lookup waits
(at most the session TTL + 1 s) for its ownership record to expire instead of sending the
client to a dead address, where it would back off for seconds."""

CLUSTER_OWNER_PROBE_CACHE_S = 1.0
"""How long a successful probe of a broker is trusted before the next lookup probes again."""

# --- transactions (PIP-473) -----------------------------------------------------------------

TXN_COORDINATOR_PARTITIONS = 16
"""Coordinator partitions (TxnID most bits); persisted by the first broker, and a broker
configured differently refuses to start (upstream's parallelism default)."""

TXN_ID_BLOCK = 256
"""TxnID counters are reserved per partition in blocks of this many by one CAS, so id
allocation writes the counter key once per block, not once per transaction."""

TXN_TIMEOUT_DEFAULT_MS = 60_000
"""A NEW_TXN without a timeout gets this one."""

TXN_TIMEOUT_MAX_MS = 3_600_000
"""Longer timeouts are clamped: an open transaction pins every reader of its topics."""

TXN_OPEN_PER_BROKER_MAX = 100_000
"""OPEN transactions a broker's coordinator created and has not seen end or expire; one
more NEW_TXN gets TooManyRequests (each costs a header record until it ends or times out,
and a client may ask for an hour's timeout)."""

TXN_OPEN_PER_CONNECTION_MAX = 1_000
"""OPEN transactions one connection created; one more NEW_TXN gets TooManyRequests."""

TXN_OPEN_PER_ROLE_MAX = 10_000
"""OPEN transactions one authenticated role has on one broker (over all its connections
and the sink batch API); one more gets TooManyRequests, so that one role cannot take the
whole TXN_OPEN_PER_BROKER_MAX from the others."""

TXN_OP_RECORDS_MAX = 1_000
"""Op records (participant registrations plus ack records) one transaction may write;
past it the write or ack fails with TransactionTooLarge."""

TXN_ENTRIES_PER_PARTICIPANT_MAX = 100_000
"""Entries one transaction may append to one topic or segment (their positions are held
in memory until the outcome)."""

TXN_ACK_POSITIONS_PER_RECORD_MAX = 1_000
"""Positions one transactional ACK may carry (one op record holds them)."""

TXN_SWEEP_INTERVAL_S = 1.0
"""How often the sweep leader looks for open transactions past their deadline."""

TXN_GC_INTERVAL_S = 30.0
"""How often the sweep leader collects finished transactions."""

TXN_GC_RETENTION_S = 300.0
"""How long a finished transaction's header is kept (a repeated END_TXN gets a precise
answer meanwhile)."""

TXN_RECONCILE_INTERVAL_S = 5.0
"""How often a participant re-reads the headers of the transactions it holds open, in
case a watch event was missed."""

TXN_SWEEP_BATCH = 500
"""Transactions one sweep or GC pass handles before yielding."""

TXN_GC_PASS_MAX = 100_000
"""Final transactions one GC pass examines per outcome (page after page): a pass every
``TXN_GC_INTERVAL_S`` must keep up with a sustained transaction rate, or headers pile up
in the metadata store (etcd's space quota is 2 GiB by default)."""

TXN_GC_READS_IN_FLIGHT = 32
"""Op-record probes a GC pass has in flight at once."""

TXN_PARTICIPANT_RETRY_MIN_S = 0.05
"""First retry delay of a participant's background outcome work (deleting op records,
writing an aborted record, applying committed acks) after a metadata or cursor failure;
it doubles per failed pass up to TXN_PARTICIPANT_RETRY_MAX_S and never gives up (the
records stay until it succeeds or a restart's recovery redoes the work)."""

TXN_PARTICIPANT_RETRY_MAX_S = 2.0
"""Longest delay between those retries."""

TXN_FINISHED_REMEMBERED_MAX = 10_000
"""Recently finished transactions a participant remembers, so a late write or ack is
refused (TransactionConflict) without reading the header; older ones read the header."""

TXN_OP_WRITE_ATTEMPTS_MAX = 8
"""Attempts to write one op record when another participant took the same sequence
number at the same moment; past it the write fails (MetadataUnavailable, retriable)."""

TXN_RECOVERY_SCAN_ENTRIES_MAX = 1_000_000
"""Entries a restarted topic reads to find the entries of its open and aborted
transactions (from the oldest op record's first_after); past it the open ones stay
pinned at their first_after until they end. Scanning for an aborted transaction goes on
to the end of the ledger (its entries must stay filtered), so this bounds only the work
done for open ones."""

TXN_BATCH_WINNERS_MAX = 4_096
"""Winning branches one batch commit names (one per Spark task of the batch); with
TXN_BRANCH_ID_BYTES_MAX they keep the header well under METADATA_VALUE_BYTES_MAX
(4096 x (128 + 3) bytes of JSON ~ 0.5 MiB)."""

TXN_BRANCH_ID_BYTES_MAX = 128
"""Longest branch id (UTF-8) in a message's ``__txn_branch`` property or a commit's
winners; a longer one is refused (InvalidArgument)."""

TXN_BATCHES_RETAINED = 100
"""Batch records a sink key keeps: committing batch N deletes those before N - 99 (as
Spark's ``minBatchesToRetain`` keeps 100 of its own logs; a restarted query replays only
its last batch), else a streaming query added a record per micro-batch forever."""

TXN_BATCHES_PRUNED_MAX = 64
"""Old batch records one commit deletes (one multi-op commit; a commit adds one)."""

TXN_SINK_KEY_BYTES_MAX = 512
"""Longest sink key (UTF-8) of a batch transaction (one segment of its record's key)."""

TXN_KEY_BYTES_MAX = 200
"""Longest transaction key (UTF-8) a client may claim (pip-transaction-key-fencing); with
the owner it is one percent-encoded segment of ``/txn/key/<owner&key>``: at most
3 x (200 + 1 + 100) + 9 = 912 bytes, under METADATA_PATH_BYTES_MAX. A longer key is
refused before anything is written."""

TXN_KEY_OWNER_BYTES_MAX = 100
"""Longest owner (the connection's authenticated role) a transaction key record names;
a longer role cannot hold a transaction key (NotAllowed)."""

TXN_KEYS_LIST_MAX = 10_000
"""Transaction keys one admin listing returns (the metrics gauge counts them all)."""

TXN_KEY_METRICS_SERIES_MAX = 1_000
"""Transaction keys that get their own ``transaction_key`` series on ``/metrics`` (epoch,
age); past it only the count grows, so a key-per-task workload cannot explode the
scrape."""

# --- hostile clients: counts a client sends, per-connection resources -----------------------

ACK_MESSAGE_IDS_MAX = 10_000
"""Message ids one ACK may carry; more is refused (InvalidArgument). Upstream clients group
at most 1000 acks per command (``maxAcknowledgmentGroupSize``)."""

REDELIVER_MESSAGE_IDS_MAX = 10_000
"""Message ids one REDELIVER_UNACKNOWLEDGED_MESSAGES handles; the rest are ignored (the
request has no answer to refuse with). Upstream clients send at most 1000 per command."""

CONSUMER_PERMITS_MAX = 2**31 - 1
"""Permits a consumer accumulates from FLOW, at most (upstream holds them in a Java int);
more is clamped. The dispatcher reads at most DISPATCH_READ_ENTRIES_MAX per pass anyway."""

SESSION_PRODUCERS_MAX = 10_000
"""Producers open (or being opened) on one connection; past it PRODUCER answers
TooManyRequests (``errors.ResourceLimitReached``)."""

SESSION_CONSUMERS_MAX = 10_000
"""Consumers open (or subscribing) on one connection; past it SUBSCRIBE answers
TooManyRequests (``errors.ResourceLimitReached``)."""

SESSION_HANDLER_TASKS_MAX = 1_000
"""Spawned handlers (PRODUCER, SUBSCRIBE, lookups, schemas, transactions) running at once
for one connection; the next such command waits for one to end, so its frames queue and
reading pauses (SESSION_COMMAND_QUEUE_MAX) instead of tasks growing without bound."""

SESSION_PENDING_LOOKUPS_MAX = 500
"""LOOKUP and PARTITIONED_METADATA requests of one connection being answered at once;
past it the request is answered at once with TooManyRequests (``ResourceLimitReached``;
the client retries with backoff). Half of SESSION_HANDLER_TASKS_MAX, so a lookup flood
cannot take every handler slot from PRODUCER/SUBSCRIBE."""

BROKER_PENDING_LOOKUPS_MAX = 50_000
"""Lookups being answered at once across the broker (upstream's
maxConcurrentLookupRequest default); past it TooManyRequests as above."""

BROKER_CONNECTIONS_MAX = 10_000
"""Client connections one broker holds (``BrokerConfig.max_connections`` may lower it);
the CONNECT of one more is answered with ERROR TooManyRequests and the connection is
closed (upstream's brokerMaxConnections, which is unbounded by default). Each costs a file
descriptor and at least two buffers."""

BROKER_CONNECTIONS_PER_IP_MAX = 10_000
"""Connections from one client address (``max_connections_per_ip`` may lower it; upstream's
brokerMaxConnectionsPerIp). Refused like the above."""

BROKER_TOPICS_MAX = 20_000
"""Topics (partitions and segments count one each) loaded on one broker
(``max_topics_per_broker`` may lower it); loading one more answers TooManyRequests
(``ResourceLimitReached``) until one is unloaded or deleted. A loaded idle topic with a
producer and a consumer costs about 30-50 KB (benchmarks/broker_footprint.py): 20,000
stay near 1 GB."""

NAMESPACE_TOPICS_MAX = 1_000_000
"""Largest ``max_topics_per_namespace`` (its default 0 means no cap, like upstream's
maxTopicsPerNamespace). At that cap a topic that would be auto-created is not: the lookup,
producer or consumer gets NotAllowed and nothing is written."""

KEY_SHARED_STICKY_RANGES_MAX = 1_000
"""Hash ranges one STICKY Key_Shared consumer may declare in SUBSCRIBE; more is refused
(ConsumerAssignError). Upstream clients declare a handful; each range costs a comparison
when consumers join."""

TOPICS_PATTERN_LENGTH_MAX = 50
"""Longest regex-subscription pattern the broker evaluates (upstream's
``subscriptionPatternMaxLength``): longer ones get an unfiltered GET_TOPICS_OF_NAMESPACE
answer (the client filters) and a refused WATCH_TOPIC_LIST."""

TOPICS_PATTERN_UNBOUNDED_QUANTIFIERS_MAX = 2
"""Unbounded quantifiers (``*``, ``+``, ``{n,}``) a pattern the broker evaluates may hold:
a failing match of ``k`` of them tries about ``len(name) ** k`` splits (ReDoS)."""

TOPICS_PATTERN_MATCH_STEPS_MAX = 2_000_000
"""Largest ``topic_patterns.match_cost`` (a bound on the backtracking steps of one match
against the longest topic name) of a pattern the broker evaluates, bounded repeats
counted as much as unbounded ones (``.{0,300}`` six times, 49 characters, is about
``len(name) ** 6``: seconds to hours of the event loop). Two unbounded quantifiers
(``.*-(eu|us)-.*``), allowed above, cost about 1.2 million on a 767-character name, a few
milliseconds of matching; ``.{0,100}`` three times (2.1 million) is over."""

TOPIC_LIST_WATCHERS_PER_CONNECTION_MAX = 1_000
"""Topic-list watchers (WATCH_TOPIC_LIST, PIP-145) one connection may hold; each costs a
metadata watch and a task (NotAllowedError past it)."""

OFFLOAD_READ_CACHE_BYTES_MAX = 64 * 1024 * 1024
"""Offloaded-ledger indexes and read-ahead entries one broker keeps in memory (tiered
storage, ``storage/tiered.py``); least recently used ones leave first."""

OFFLOAD_READ_AHEAD_BYTES = 4 * 1024 * 1024
"""A read of an offloaded ledger fetches up to this much past what it asked for (one
ranged GET serves a sequential consumer for a while)."""

OFFLOAD_OBJECT_BYTES_MAX = 1024 * 1024 * 1024
"""Largest ledger offloaded: its object is built in memory and uploaded in one
create-only put (multipart uploads cannot be create-only). The default ledger rollover
(256 MB) stays well under it."""

STATS_RATE_WINDOW_MIN_S = 1.0
"""Admin stats rates (msgRateIn/Out, throughput) are over at least this long: a stats call
sooner than this after the last mark reuses it rather than measuring a few milliseconds."""

# --- non-persistent topics -----------------------------------------------------------------

NON_PERSISTENT_SUBSCRIPTIONS_MAX = 10_000
"""Subscriptions one non-persistent topic holds at once (each lives only while it has
consumers); one more is refused with TooManyRequests (``ResourceLimitReached``)."""

NON_PERSISTENT_CONSUMERS_MAX = 10_000
"""Consumers one non-persistent topic holds at once, over all its subscriptions; refused
like the above."""

NON_PERSISTENT_IDLE_S = 60.0
"""A non-persistent topic without producers and subscriptions for this long is unloaded
(it holds nothing; upstream's inactive-topic GC), freeing its place under
``max_topics_per_broker`` and, in cluster mode, its ownership."""

NON_PERSISTENT_IDLE_SWEEP_S = 15.0
"""How often the broker looks for idle non-persistent topics."""

NON_PERSISTENT_INFLIGHT_BYTES_MAX = 16 * 1024 * 1024
"""Bytes one non-persistent topic may hand to its consumers' connections within one event
loop iteration (before they are flushed to the sockets): a pipelined burst fanned out to
many consumers is bounded by it. A send past it is dropped, counted on its publisher,
and answered with the (-1, -1) receipt, as upstream answers a send over
maxConcurrentNonPersistentMessagePerConnection."""

# --- schema registry -----------------------------------------------------------------------

SCHEMA_HISTORY_PAGE_RECORDS = 16
"""Schema version records read per store call when a request walks a topic's history (a
transitive strategy's check of a new schema, the admin's all-versions listing, indexing a
history written without an index): at most 16 MiB of values at once, each being at most
METADATA_VALUE_BYTES_MAX. Every other schema request reads a few records, whatever the
history's length (``broker/schema.py``)."""

SCHEMA_HISTORY_WALKS_MAX = 2
"""Such walks running at once per broker; the next waits for one to end. With the page
bound, walks hold at most about 2 x 16 MiB of records and their decoded schemas, however
many clients ask (a topic holds up to 1000 versions of up to 1 MiB)."""

SCHEMA_DECODE_INLINE_BYTES_MAX = 64 * 1024
"""Stored schema bytes decoded (JSON, base64, Avro checks) on the event loop; a larger
record or page is decoded on a worker thread so that other connections are not held up
for the milliseconds a megabyte takes. Schemas are usually a few KiB."""
