"""A small JetStream client over ``nats-py``'s core connection: what the ledger needs.

``nats-py``'s JetStream layer is not used on the hot path: its ``publish_async`` never
completes when the server answers with an API error (nats.py issue #985), and it has no
atomic batch publish. This module speaks the JetStream wire API directly:

* ``$JS.API.*`` requests (stream create/info/purge/delete, leader ``MSG.GET``) are JSON
  request/reply; an ``error`` object becomes a typed :class:`ApiError`;
* :meth:`JetStreamClient.publish_batch` sends an atomic batch (server 2.12+: headers
  ``Nats-Batch-Id`` / ``Nats-Batch-Sequence`` / ``Nats-Batch-Commit``; the first message
  carries ``Nats-Expected-Last-Sequence``, so the whole batch is stored only if nothing
  else was appended since — the fence) and awaits the one reply to the commit message;
* :meth:`JetStreamClient.direct_get` reads a run of sequences with one batch direct get
  (``allow_direct`` streams: any current replica answers), ending at the ``EOB`` status.

Every reply comes back on one wildcard subscription of a private inbox and is routed by
its last token, so there is no subscription per request. Timeouts bound every wait; the
caller decides what a timeout means (the ledger reads the sequence back). A timeout also
sends the server a PING: a server that answers no PONG within ``PROBE_TIMEOUT_S`` is taken
for hung and the connection moves to another server of the pool at once. nats-py's own
pings would notice only after ``PING_INTERVAL_S`` times ``MAX_OUTSTANDING_PINGS`` (15-20 s),
and every broker connected to a hung (SIGSTOPped, blackholed) server stopped writing for
that long while the other servers had long elected new stream leaders.

Example (against NATS servers with JetStream)::

    async def demo(urls: list[str]) -> None:
        client = await JetStreamClient.connect(urls)
        await client.create_stream({"name": "S", "subjects": ["S.>"], "storage": "file"})
        ack = await client.publish_batch("S.e", [b"a", b"b"], expected_last_seq=0)
        assert ack.last_seq == 2
        assert [m.data for m in await client.direct_get("S", 1, 2)] == [b"a", b"b"]
        await client.close()
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import json
import logging
import ssl
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from anabranch.core.log_throttle import LogThrottle
from anabranch.errors import StorageIOError
from anabranch.storage.nats_transport import close_replaced_writers

log = logging.getLogger(__name__)

close_replaced_writers()  # nats-py leaks a socket per failed reconnect handshake otherwise

API_TIMEOUT_S = 5.0
"""How long one JetStream API request waits for its reply."""

PING_INTERVAL_S = 5
MAX_OUTSTANDING_PINGS = 3
"""nats-py's idle keep-alive: a connection is stale after this many unanswered PINGs."""
PROBE_TIMEOUT_S = 1
"""How long the PING sent after a request timed out may go unanswered before the
connection is abandoned for another server (an int: nats-py's ``flush`` takes seconds)."""

ERR_WRONG_LAST_SEQUENCE = 10071
ERR_STREAM_NOT_FOUND = 10059
ERR_NO_MESSAGE_FOUND = 10037
ERR_STREAM_NAME_IN_USE = 10058
ERR_NO_SUITABLE_PEERS = 10005
ERR_STREAM_SEALED = 10109

CONNECTION_ERROR_LOG_INTERVAL_S = 10.0
"""At most one log line per kind of connection error this often (an outage would log
every reconnect attempt, four a second)."""
CONNECTION_ERRORS_KEPT = 16
"""Connection errors remembered for the message of a failed connect."""

BATCH_MESSAGES_MAX = 1000
"""Messages per atomic batch (the server's default limit)."""


class ApiError(StorageIOError):
    """A JetStream API error reply (``code``, ``err_code``, ``description``)."""

    def __init__(self, code: int, err_code: int, description: str) -> None:
        super().__init__(f"JetStream error {code}/{err_code}: {description}")
        self.code = code
        self.err_code = err_code
        self.description = description


class WrongLastSequence(ApiError):
    """``Nats-Expected-Last-Sequence`` did not match: someone else appended (a fence)."""


class StreamNotFound(ApiError):
    """The stream does not exist (never created, or deleted behind our back)."""


class MessageNotFound(ApiError):
    """No message at that sequence (or for that subject)."""


class NatsAuthError(StorageIOError):
    """The NATS servers refused our credentials (user/password, token, .creds)."""

    retriable = False


def redact_url(url: str) -> str:
    """``url`` without the user:password part, for messages and logs.

    >>> redact_url("nats://broker:s3cret@nats-1:4222")
    'nats://nats-1:4222'
    """
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit(parts._replace(netloc=netloc))


def _is_auth(err: BaseException) -> bool:
    text = str(err).lower()
    return "authorization" in text or "authentication" in text


class ReplyTimeout(StorageIOError):
    """No reply in time: the request may or may not have taken effect."""


def api_error(err: dict[str, Any]) -> ApiError:
    code = int(err.get("code", 0))
    err_code = int(err.get("err_code", 0))
    description = str(err.get("description", ""))
    kind: type[ApiError] = ApiError
    if err_code == ERR_WRONG_LAST_SEQUENCE:
        kind = WrongLastSequence
    elif err_code == ERR_STREAM_NOT_FOUND:
        kind = StreamNotFound
    elif err_code == ERR_NO_MESSAGE_FOUND or code == 404:
        kind = MessageNotFound
    return kind(code, err_code, description)


@dataclass(frozen=True, slots=True)
class StoredMsg:
    """One stored message as a read returns it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PubAck:
    """The reply to a committed batch: the sequence of its last message, and its count."""

    last_seq: int
    count: int
    batch_id: str


def parse_headers(raw: bytes) -> dict[str, str]:
    """Headers of a ``MSG.GET`` reply (``NATS/1.0\\r\\nKey: value\\r\\n...``).

    >>> parse_headers(b"NATS/1.0\\r\\nNats-Batch-Id: abc\\r\\n\\r\\n")
    {'Nats-Batch-Id': 'abc'}
    """
    out: dict[str, str] = {}
    for line in raw.decode(errors="replace").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


class _Reads:
    """Collects the messages of one batch direct get until its end-of-batch status."""

    __slots__ = ("done", "msgs")

    def __init__(self, done: asyncio.Future[int]) -> None:
        self.msgs: list[StoredMsg] = []
        self.done = done


class JetStreamClient:
    """One NATS connection, its reply inbox, and the JetStream calls the ledger makes."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._tokens = itertools.count()
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        self._reads: dict[str, _Reads] = {}
        self._probe: asyncio.Task[None] | None = None
        self.hung_servers_left = 0
        """Connections abandoned because their server answered no PING (metrics, tests)."""

    @classmethod
    async def connect(
        cls,
        urls: Sequence[str],
        *,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        credentials_file: str | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout_s: float = 30.0,
        name: str = "anabranch",
    ) -> JetStreamClient:
        """Connect to any of ``urls``, retrying with backoff for ``connect_timeout_s``;
        then StorageIOError naming the URLs and the server's last complaint (never a
        credential). Refused credentials fail at once with NatsAuthError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout_s
        delay = 0.1
        # One for the connection's life: nats-py reports every refused reconnect.
        throttle = LogThrottle(CONNECTION_ERROR_LOG_INTERVAL_S)
        while True:
            nc = Client()
            # The callback outlives the connect (it sees every later reconnect error):
            # only the latest few are kept, for the connect's error message.
            seen: deque[Exception] = deque(maxlen=CONNECTION_ERRORS_KEPT)
            refused: asyncio.Future[None] = loop.create_future()

            async def on_error(
                err: Exception,
                seen: deque[Exception] = seen,
                refused: asyncio.Future[None] = refused,
            ) -> None:
                seen.append(err)
                if _is_auth(err) and not refused.done():
                    refused.set_result(None)  # stop nats-py's own retrying at once
                _log_error(err, throttle)

            try:
                options: dict[str, Any] = {
                    "servers": list(urls),
                    "name": name,
                    "allow_reconnect": True,
                    "max_reconnect_attempts": -1,
                    "reconnect_time_wait": 0.25,
                    "connect_timeout": 2,
                    "ping_interval": PING_INTERVAL_S,
                    "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
                    "error_cb": on_error,
                }
                if user is not None:
                    options["user"] = user
                    options["password"] = password
                if token is not None:
                    options["token"] = token
                if credentials_file is not None:
                    options["user_credentials"] = credentials_file
                if tls is not None:
                    options["tls"] = tls
                # nats-py keeps retrying an initial connect that allows reconnects: bound it.
                remaining = min(max(deadline - loop.time(), 0.1), 5.0)
                connecting = asyncio.ensure_future(nc.connect(**options))
                await asyncio.wait(
                    (connecting, refused), timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                if not connecting.done():
                    connecting.cancel()
                    await asyncio.gather(connecting, return_exceptions=True)
                    raise TimeoutError("no connection")
                connecting.result()
            except (NatsError, OSError, TimeoutError) as err:
                with contextlib.suppress(NatsError, OSError):
                    await nc.close()
                where = ", ".join(redact_url(u) for u in urls)
                complaint = next((e for e in reversed([err, *seen]) if _is_auth(e)), None)
                if complaint is not None:
                    raise NatsAuthError(
                        f"NATS JetStream at {where} refused our credentials: {complaint}"
                    ) from err
                if loop.time() + delay > deadline:
                    last = seen[-1] if seen and isinstance(err, TimeoutError) else err
                    raise StorageIOError(
                        f"cannot reach NATS JetStream at {where}: {type(last).__name__} {last}"
                    ) from err
                log.warning("NATS at %s unreachable (%r); retrying", where, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            client = cls(nc)
            await nc.subscribe(client._prefix + ".*", cb=client._on_reply)
            return client

    @property
    def connected_url(self) -> str | None:
        """The server this connection uses now (credentials left out); None while
        reconnecting."""
        url = self._nc.connected_url
        return None if url is None else redact_url(url.geturl())

    @property
    def max_payload(self) -> int:
        return int(self._nc.max_payload)

    async def close(self) -> None:
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(StorageIOError("NATS connection closed"))
        for reads in self._reads.values():
            if not reads.done.done():
                reads.done.set_exception(StorageIOError("NATS connection closed"))
        self._acks.clear()
        self._reads.clear()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        try:
            await self._nc.close()
        except NatsError:
            pass

    # --- replies -------------------------------------------------------------------------------

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        fut = self._acks.pop(token, None)
        if fut is not None:
            if not fut.done():
                fut.set_result(msg)
            return
        reads = self._reads.get(token)
        if reads is None or reads.done.done():
            return
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None:
            reads.msgs.append(
                StoredMsg(
                    int(headers.get("Nats-Sequence", "0")),
                    headers.get("Nats-Subject", ""),
                    msg.data,
                    headers,
                )
            )
        else:
            reads.done.set_result(int(status))

    def _token(self) -> str:
        return str(next(self._tokens))

    # --- liveness ------------------------------------------------------------------------------

    def _timed_out(self, message: str) -> ReplyTimeout:
        """The error of a request that got no reply; checks the server answers at all."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._check_server())
        return ReplyTimeout(message)

    async def _check_server(self) -> None:
        nc = self._nc
        if not nc.is_connected:
            return  # nats-py is already reconnecting
        server = nc.connected_url
        try:
            await nc.flush(timeout=PROBE_TIMEOUT_S)
        except TimeoutError:
            # A live server whose stream has no leader yet still answers PINGs: only a
            # hung one (or a dead link without a reset) gets here.
            if nc.connected_url is not server:
                return
            self.hung_servers_left += 1
            log.warning(
                "NATS server %s answered no PING within %ss: switching servers",
                redact_url(server.geturl()) if server is not None else "?",
                PROBE_TIMEOUT_S,
            )
            await nc.force_reconnect()
        except NatsError:
            pass  # closed or reconnecting meanwhile: nothing to do

    # --- API requests ----------------------------------------------------------------------------

    async def api(
        self, subject: str, body: dict[str, Any] | None = None, timeout_s: float = API_TIMEOUT_S
    ) -> dict[str, Any]:
        """One ``$JS.API`` request; an error reply raises the matching :class:`ApiError`."""
        payload = json.dumps(body).encode() if body is not None else b""
        try:
            reply = await self._nc.request(subject, payload, timeout=timeout_s)
        except TimeoutError as err:
            raise self._timed_out(f"no reply to {subject} within {timeout_s}s") from err
        except NatsError as err:
            raise StorageIOError(f"{subject}: {type(err).__name__} {err}") from err
        try:
            out: dict[str, Any] = json.loads(reply.data)
        except ValueError as err:
            raise StorageIOError(f"{subject}: unreadable reply") from err
        if "error" in out:
            raise api_error(out["error"])
        return out

    async def create_stream(self, config: dict[str, Any]) -> dict[str, Any]:
        """Create the stream, or return the existing one's info (same name)."""
        name = config["name"]
        try:
            return await self.api(f"$JS.API.STREAM.CREATE.{name}", config)
        except ApiError as err:
            if err.err_code != ERR_STREAM_NAME_IN_USE:
                raise
        return await self.stream_info(name)

    async def stream_info(self, stream: str, timeout_s: float = API_TIMEOUT_S) -> dict[str, Any]:
        return await self.api(f"$JS.API.STREAM.INFO.{stream}", timeout_s=timeout_s)

    async def last_seq(self, stream: str, timeout_s: float = API_TIMEOUT_S) -> int:
        """The stream's last sequence, from the leader."""
        info = await self.stream_info(stream, timeout_s)
        return int(info["state"]["last_seq"])

    async def seal_stream(self, config: dict[str, Any]) -> dict[str, Any]:
        """Mark the stream sealed (no more writes, purges or deletes of messages; reads
        and deleting the whole stream still work); returns its fresh info."""
        name = config["name"]
        return await self.api(f"$JS.API.STREAM.UPDATE.{name}", {**config, "sealed": True})

    async def purge_below(self, stream: str, seq: int) -> int:
        """Remove every message with a sequence below ``seq``; how many went."""
        out = await self.api(f"$JS.API.STREAM.PURGE.{stream}", {"seq": seq})
        return int(out.get("purged", 0))

    async def delete_stream(self, stream: str) -> None:
        try:
            await self.api(f"$JS.API.STREAM.DELETE.{stream}")
        except StreamNotFound:
            pass

    async def msg_get(
        self,
        stream: str,
        *,
        seq: int | None = None,
        last_by_subj: str | None = None,
        next_by_subj: str | None = None,
        timeout_s: float = API_TIMEOUT_S,
    ) -> StoredMsg | None:
        """One message from the stream leader (a consistent read), or None if absent."""
        body: dict[str, Any] = {}
        if seq is not None:
            body["seq"] = seq
        if last_by_subj is not None:
            body["last_by_subj"] = last_by_subj
        if next_by_subj is not None:
            body["next_by_subj"] = next_by_subj
        try:
            out = await self.api(f"$JS.API.STREAM.MSG.GET.{stream}", body, timeout_s)
        except MessageNotFound:
            return None
        message = out["message"]
        try:
            data = base64.b64decode(message.get("data") or "")
            raw_headers = base64.b64decode(message.get("hdrs") or "")
        except (binascii.Error, ValueError) as err:
            raise StorageIOError(f"{stream}: unreadable MSG.GET reply") from err
        return StoredMsg(
            int(message["seq"]), str(message["subject"]), data, parse_headers(raw_headers)
        )

    # --- the hot path -------------------------------------------------------------------------

    async def publish_batch(
        self,
        subject: str,
        payloads: Sequence[bytes],
        *,
        expected_last_seq: int,
        timeout_s: float = API_TIMEOUT_S,
        batch_id: str | None = None,
    ) -> PubAck:
        """Store ``payloads`` atomically after ``expected_last_seq``; the reply to the
        commit message says where the last one went. Raises WrongLastSequence (fenced),
        another ApiError, or ReplyTimeout (outcome unknown: read the sequence back)."""
        if not payloads:
            raise ValueError("empty batch")
        batch_id = batch_id or uuid.uuid4().hex[:22]
        token = self._token()
        fut: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._acks[token] = fut
        reply = f"{self._prefix}.{token}"
        last = len(payloads)
        publish = self._nc.publish
        try:
            for i, data in enumerate(payloads, 1):
                headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i)}
                if i == 1:
                    headers["Nats-Expected-Last-Sequence"] = str(expected_last_seq)
                if i == last:
                    headers["Nats-Batch-Commit"] = "1"
                    await publish(subject, data, reply=reply, headers=headers)
                else:
                    await publish(subject, data, headers=headers)
            try:
                msg = await asyncio.wait_for(fut, timeout_s)
            except TimeoutError as err:
                raise self._timed_out(f"no ack for batch {batch_id} within {timeout_s}s") from err
        except NatsError as err:
            raise StorageIOError(f"publish to {subject}: {type(err).__name__} {err}") from err
        finally:
            self._acks.pop(token, None)
        if msg.headers and msg.headers.get("Status") == "503":
            raise StorageIOError(f"publish to {subject}: no responders (no stream leader)")
        try:
            out = json.loads(msg.data)
        except ValueError as err:
            raise StorageIOError(f"publish to {subject}: unreadable ack") from err
        if "error" in out:
            raise api_error(out["error"])
        return PubAck(int(out["seq"]), int(out.get("count", last)), batch_id)

    async def publish_one(
        self,
        subject: str,
        data: bytes,
        *,
        expected_last_seq: int,
        timeout_s: float = API_TIMEOUT_S,
    ) -> int:
        """A single conditional publish (markers); returns its sequence."""
        headers = {"Nats-Expected-Last-Sequence": str(expected_last_seq)}
        try:
            reply = await self._nc.request(subject, data, timeout=timeout_s, headers=headers)
        except TimeoutError as err:
            raise self._timed_out(f"no ack for {subject} within {timeout_s}s") from err
        except NatsError as err:
            raise StorageIOError(f"publish to {subject}: {type(err).__name__} {err}") from err
        try:
            out = json.loads(reply.data)
        except ValueError as err:
            raise StorageIOError(f"publish to {subject}: unreadable ack") from err
        if "error" in out:
            raise api_error(out["error"])
        return int(out["seq"])

    async def direct_get(
        self,
        stream: str,
        seq: int,
        count: int,
        *,
        max_bytes: int | None = None,
        timeout_s: float = API_TIMEOUT_S,
    ) -> list[StoredMsg]:
        """Up to ``count`` messages from ``seq`` on, from any current replica (possibly
        fewer: the byte budget, the end of the stream, or a lagging replica)."""
        token = self._token()
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        reads = self._reads[token] = _Reads(done)
        body: dict[str, Any] = {"seq": seq, "batch": count}
        if max_bytes is not None:
            body["max_bytes"] = max_bytes
        try:
            await self._nc.publish(
                f"$JS.API.DIRECT.GET.{stream}",
                json.dumps(body).encode(),
                reply=f"{self._prefix}.{token}",
            )
            try:
                await asyncio.wait_for(done, timeout_s)
            except TimeoutError as err:
                raise self._timed_out(f"no end of batch from {stream} within {timeout_s}s") from err
        except NatsError as err:
            raise StorageIOError(f"direct get {stream}: {type(err).__name__} {err}") from err
        finally:
            self._reads.pop(token, None)
        return reads.msgs


def _log_error(err: Exception, throttle: LogThrottle) -> None:
    left_out = throttle.admit(type(err).__name__, time.monotonic())
    if left_out is None:
        return
    if left_out:
        log.warning("NATS connection: %r (and %d more errors since the last line)", err, left_out)
    else:
        log.warning("NATS connection: %r", err)


__all__ = [
    "ApiError",
    "JetStreamClient",
    "MessageNotFound",
    "NatsAuthError",
    "PubAck",
    "ReplyTimeout",
    "StoredMsg",
    "StreamNotFound",
    "WrongLastSequence",
]
