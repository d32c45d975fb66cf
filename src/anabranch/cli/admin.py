"""``anabranch admin``: clusters, tenants, namespaces, topics and transactions over the
admin REST API.

Tables by default (rich), ``--output json`` for scripts (on ``admin`` or on any command).
Errors print the server's reason on stderr and exit 1 (2 when the broker is unreachable).

Example:
    $ anabranch admin tenants list
    $ anabranch admin topics create public/default/orders --partitions 4
    $ anabranch admin --admin-url http://broker:8080 topics stats orders-partition-0 --output json
    $ anabranch admin transactions coordinator-stats
    $ anabranch admin transactions slow-transactions --timeout-ms 60000 --output json
    $ anabranch admin transactions list-transaction-keys
    $ anabranch admin transactions delete-transaction-key etl-7 --output json
    $ anabranch admin --admin-url https://broker:8443 --tls-trust-certs ca.pem \
        --auth-token-file admin.jwt tenants list
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from anabranch.admin.client import (
    DEFAULT_ADMIN_URL,
    AdminClient,
    AdminHttpError,
    AdminUnreachable,
)
from anabranch.client.auth import (
    Authentication,
    AuthenticationBasic,
    AuthenticationTLS,
    AuthenticationToken,
)
from anabranch.core.segment_layout import Segment, SegmentLayout
from anabranch.errors import InvalidArgument

admin_app = typer.Typer(no_args_is_help=True, help="Administer a broker over its admin API.")
clusters_app = typer.Typer(no_args_is_help=True, help="Clusters.")
tenants_app = typer.Typer(no_args_is_help=True, help="Tenants.")
namespaces_app = typer.Typer(no_args_is_help=True, help="Namespaces and their policies.")
topics_app = typer.Typer(no_args_is_help=True, help="Persistent topics and subscriptions.")
admin_app.add_typer(clusters_app, name="clusters")
admin_app.add_typer(tenants_app, name="tenants")
admin_app.add_typer(namespaces_app, name="namespaces")
admin_app.add_typer(topics_app, name="topics")
scalable_app = typer.Typer(no_args_is_help=True, help="Scalable topics (PIP-468) and their DAG.")
admin_app.add_typer(scalable_app, name="scalable")
transactions_app = typer.Typer(
    no_args_is_help=True, help="Transactions (PIP-473): coordinator, buffer and pending-ack stats."
)
admin_app.add_typer(transactions_app, name="transactions")

stdout = Console()
stderr = Console(stderr=True)


class Output(StrEnum):
    table = "table"
    json = "json"


OutputOpt = Annotated[
    Output | None, typer.Option("--output", "-o", help="table (default) or json.")
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Even while clients are connected.")]


class _Settings:
    url: str = DEFAULT_ADMIN_URL
    output: Output = Output.table
    auth: Authentication | None = None
    tls_trust_certs: str | None = None
    tls_allow_insecure: bool = False

    def client(self) -> AdminClient:
        """An admin client with the URL, credentials and TLS options given."""
        return AdminClient(
            self.url,
            auth=self.auth,
            tls_trust_certs_file_path=self.tls_trust_certs,
            tls_allow_insecure_connection=self.tls_allow_insecure,
        )


_settings = _Settings()


@admin_app.callback()
def _admin(
    *,
    admin_url: Annotated[
        str, typer.Option("--admin-url", envvar="ANABRANCH_ADMIN_URL", help="Admin HTTP URL.")
    ] = DEFAULT_ADMIN_URL,
    output: Annotated[Output, typer.Option("--output", "-o", help="table or json.")] = (
        Output.table
    ),
    auth_token: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_AUTH_TOKEN", help="JWT sent as Authorization: Bearer."),
    ] = None,
    auth_token_file: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_AUTH_TOKEN_FILE", help="File holding the JWT."),
    ] = None,
    auth_user: Annotated[
        str | None, typer.Option(envvar="ANABRANCH_AUTH_USER", help="Basic-auth user.")
    ] = None,
    auth_password: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_AUTH_PASSWORD", help="Basic-auth password."),
    ] = None,
    tls_cert_file: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_TLS_CERT_FILE", help="Client certificate (TLS auth)."),
    ] = None,
    tls_key_file: Annotated[
        str | None,
        typer.Option(envvar="ANABRANCH_TLS_KEY_FILE", help="Client certificate's key."),
    ] = None,
    tls_trust_certs: Annotated[
        str | None,
        typer.Option(
            envvar="ANABRANCH_TLS_TRUST_CERTS",
            help="CA bundle the https:// broker is checked with.",
        ),
    ] = None,
    tls_allow_insecure: Annotated[
        bool, typer.Option(help="Accept any broker certificate (testing only).")
    ] = False,
) -> None:
    """Administer a broker over its admin API."""
    _settings.url = admin_url
    _settings.output = output
    _settings.tls_trust_certs = tls_trust_certs
    _settings.tls_allow_insecure = tls_allow_insecure
    with _reported():  # an unusable token is the same one-line error as a refused call
        _settings.auth = cli_authentication(
            token=auth_token,
            token_file=auth_token_file,
            user=auth_user,
            password=auth_password,
            cert_file=tls_cert_file,
            key_file=tls_key_file,
        )


def cli_authentication(
    *,
    token: str | None,
    token_file: str | None,
    user: str | None,
    password: str | None,
    cert_file: str | None,
    key_file: str | None,
) -> Authentication | None:
    """The one authentication the options name (token, token file, basic or TLS).

    A token (given, or read from its file) is checked here: InvalidArgument when the file
    cannot be read or the token holds a control character.

    Example:
        >>> none = dict(token=None, token_file=None, user=None, password=None,
        ...             cert_file=None, key_file=None)
        >>> cli_authentication(**{**none, "token": "t"}).method
        'token'
        >>> cli_authentication(**none) is None
        True
        >>> cli_authentication(**{**none, "token": "a\\nb"})
        Traceback (most recent call last):
        anabranch.errors.InvalidArgument: --auth-token contains a control character
    """
    given: list[Authentication] = []
    if token:
        given.append(AuthenticationToken(checked_token(token, "--auth-token")))
    if token_file:
        given.append(AuthenticationToken(read_token_file(token_file)))
    if user is not None or password is not None:
        given.append(AuthenticationBasic(user or "", password or ""))
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise typer.BadParameter("--tls-cert-file and --tls-key-file go together")
        given.append(AuthenticationTLS(cert_file, key_file))
    if len(given) > 1:
        raise typer.BadParameter("give one of: a token, a token file, basic, a certificate")
    return given[0] if given else None


def checked_token(token: str, source: str) -> str:
    """``token``, unless it holds a control character: InvalidArgument naming ``source``.

    It travels in an HTTP header, where a CR/LF would split the request (aiohttp refuses to
    send one: a traceback, not a reason) and no other control character belongs in a JWT.

    Example:
        >>> checked_token("eyJ0.e30.sig", "--auth-token")
        'eyJ0.e30.sig'
        >>> checked_token("eyJ0\\r\\n.e30", "token file t.jwt")
        Traceback (most recent call last):
        anabranch.errors.InvalidArgument: token file t.jwt contains a control character
    """
    if any(ch < " " or ch == "\x7f" for ch in token):
        raise InvalidArgument(f"{source} contains a control character")
    return token


def read_token_file(spec: str) -> str:
    """The token in the file ``spec`` names (a path or ``file://`` URL), surrounding white
    space stripped; InvalidArgument when it cannot be read, is empty or holds a control
    character (a CR/LF inside the token).

    Read once, up front: a CLI command is one short session, and an unreadable file is
    then reported as such rather than as an unreachable broker.

    Example:
        >>> import tempfile
        >>> f = Path(tempfile.mkdtemp()) / "admin.jwt"
        >>> _ = f.write_text("eyJ0.e30.sig\\n")
        >>> read_token_file(f"file://{f}")
        'eyJ0.e30.sig'
    """
    path = Path(spec.removeprefix("file://"))
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as err:
        raise InvalidArgument(f"cannot read token file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise InvalidArgument(f"cannot read token file {path}: not UTF-8 text") from None
    if not token:
        raise InvalidArgument(f"token file {path} is empty")
    return checked_token(token, f"token file {path}")


# --- running and printing ---------------------------------------------------------------------


def _run(call: Callable[[AdminClient], Awaitable[Any]], output: Output | None, title: str) -> None:
    """Run one admin call, print its answer, map failures to exit codes."""
    _print(_call(call), output or _settings.output, title)


def _call(call: Callable[[AdminClient], Awaitable[Any]]) -> Any:
    """Run one admin call and answer its result; failures print and exit (see
    :func:`_reported`)."""

    async def go() -> Any:
        async with _settings.client() as client:
            return await call(client)

    with _reported():
        return asyncio.run(go())


@contextlib.contextmanager
def _reported() -> Iterator[None]:
    """The admin commands' one error path: a refused call, a bad argument or file, or an
    unreachable broker prints ``error: <reason>`` on stderr and exits 1 (2: unreachable).

    Reasons are escaped: they quote names and server text, where a ``[/x]`` would be read
    as rich markup (a MarkupError traceback instead of the reason)."""
    try:
        yield
    except AdminHttpError as err:
        stderr.print(f"[red]error[/]: {escape(_http_reason(err))}")
        raise typer.Exit(1) from None
    except InvalidArgument as err:
        stderr.print(f"[red]error[/]: {escape(str(err))}")
        raise typer.Exit(1) from None
    except AdminUnreachable as err:
        stderr.print(f"[red]error[/]: cannot reach {escape(_settings.url)}: {escape(err.reason)}")
        raise typer.Exit(2) from None
    except (aiohttp.ClientError, OSError) as err:
        stderr.print(f"[red]error[/]: cannot reach {escape(_settings.url)}: {escape(str(err))}")
        raise typer.Exit(2) from None


_SCALABLE_AS_PERSISTENT = "/admin/v2/topic/"
"""Where the client sends a persistent-topic call given a scalable ``topic://`` name: the
broker has no such routes (scalable topics live under ``/admin/v2/scalable/``), so its
answer is a bare 404."""


def _http_reason(err: AdminHttpError) -> str:
    """``HTTP <status>: <reason>``; for a ``topics`` command given a scalable ``topic://``
    name, also which commands serve those.

    Example:
        >>> _http_reason(AdminHttpError("GET", "/admin/v2/tenants/x", 404, "Tenant not found"))
        'HTTP 404: Tenant not found'
    """
    text = f"HTTP {err.status}: {err.reason}"
    if err.status == 404 and err.path.startswith(_SCALABLE_AS_PERSISTENT):
        text += (
            " (a topic:// name is a scalable topic, which `anabranch admin topics` does not"
            " serve: see `anabranch admin scalable --help`, e.g. `scalable stats`)"
        )
    return text


def _print(result: Any, output: Output, title: str) -> None:
    if output is Output.json:
        typer.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    # Titles and values quote names and message payloads: escaped, not read as markup.
    if result is None:
        stdout.print(f"[green]ok[/] {escape(title)}")
    elif isinstance(result, list):
        table = Table(title=escape(title))
        table.add_column("name")
        for item in result:
            table.add_row(escape(str(item)))
        stdout.print(table)
    elif isinstance(result, dict):
        table = Table(title=escape(title))
        table.add_column("field")
        table.add_column("value")
        for key, value in result.items():
            text = json.dumps(value) if isinstance(value, dict | list) else str(value)
            table.add_row(escape(str(key)), escape(text))
        stdout.print(table)
    else:
        stdout.print(escape(str(result)))


def _message_id(text: str) -> tuple[int, int]:
    """``earliest``, ``latest`` or ``ledger:entry``."""
    if text == "earliest":
        return (-1, -1)
    if text == "latest":
        return (2**63 - 1, 2**63 - 1)
    ledger, sep, entry = text.partition(":")
    try:
        if sep:
            return (int(ledger), int(entry))
    except ValueError:
        pass
    raise typer.BadParameter(f"{text!r} is not earliest, latest or <ledger>:<entry>")


# --- clusters ---------------------------------------------------------------------------------


@clusters_app.command("list")
def clusters_list(output: OutputOpt = None) -> None:
    """List clusters."""
    _run(lambda c: c.list_clusters(), output, "clusters")


@clusters_app.command("get")
def clusters_get(name: str, output: OutputOpt = None) -> None:
    """Show a cluster."""
    _run(lambda c: c.get_cluster(name), output, f"cluster {name}")


@clusters_app.command("create")
def clusters_create(
    name: str,
    service_url: Annotated[str, typer.Option(help="http://host:8080")] = "",
    broker_service_url: Annotated[str, typer.Option(help="pulsar://host:6650")] = "",
    output: OutputOpt = None,
) -> None:
    """Create a cluster."""
    _run(lambda c: c.create_cluster(name, service_url, broker_service_url), output,
         f"created cluster {name}")  # fmt: skip


@clusters_app.command("delete")
def clusters_delete(name: str, output: OutputOpt = None) -> None:
    """Delete a cluster."""
    _run(lambda c: c.delete_cluster(name), output, f"deleted cluster {name}")


# --- tenants ----------------------------------------------------------------------------------


def _csv(text: str) -> list[str]:
    return [part for part in (p.strip() for p in text.split(",")) if part]


@tenants_app.command("list")
def tenants_list(output: OutputOpt = None) -> None:
    """List tenants."""
    _run(lambda c: c.list_tenants(), output, "tenants")


@tenants_app.command("get")
def tenants_get(name: str, output: OutputOpt = None) -> None:
    """Show a tenant."""
    _run(lambda c: c.get_tenant(name), output, f"tenant {name}")


@tenants_app.command("create")
def tenants_create(
    name: str,
    allowed_clusters: Annotated[str, typer.Option(help="Comma-separated cluster names.")] = "",
    admin_roles: Annotated[str, typer.Option(help="Comma-separated roles.")] = "",
    output: OutputOpt = None,
) -> None:
    """Create a tenant."""
    _run(lambda c: c.create_tenant(name, _csv(allowed_clusters), _csv(admin_roles)), output,
         f"created tenant {name}")  # fmt: skip


@tenants_app.command("update")
def tenants_update(
    name: str,
    allowed_clusters: Annotated[str, typer.Option(help="Comma-separated cluster names.")] = "",
    admin_roles: Annotated[str, typer.Option(help="Comma-separated roles.")] = "",
    output: OutputOpt = None,
) -> None:
    """Replace a tenant's clusters and roles."""
    _run(lambda c: c.update_tenant(name, _csv(allowed_clusters), _csv(admin_roles)), output,
         f"updated tenant {name}")  # fmt: skip


@tenants_app.command("delete")
def tenants_delete(name: str, output: OutputOpt = None) -> None:
    """Delete an empty tenant."""
    _run(lambda c: c.delete_tenant(name), output, f"deleted tenant {name}")


# --- namespaces -------------------------------------------------------------------------------


@namespaces_app.command("list")
def namespaces_list(tenant: str, output: OutputOpt = None) -> None:
    """List a tenant's namespaces."""
    _run(lambda c: c.list_namespaces(tenant), output, f"namespaces of {tenant}")


@namespaces_app.command("create")
def namespaces_create(namespace: str, output: OutputOpt = None) -> None:
    """Create a namespace (tenant/ns)."""
    _run(lambda c: c.create_namespace(namespace), output, f"created namespace {namespace}")


@namespaces_app.command("get")
def namespaces_get(namespace: str, output: OutputOpt = None) -> None:
    """Show a namespace's policies."""
    _run(lambda c: c.get_namespace_policies(namespace), output, f"policies of {namespace}")


@namespaces_app.command("delete")
def namespaces_delete(namespace: str, output: OutputOpt = None) -> None:
    """Delete an empty namespace."""
    _run(lambda c: c.delete_namespace(namespace), output, f"deleted namespace {namespace}")


@namespaces_app.command("topics")
def namespaces_topics(namespace: str, output: OutputOpt = None) -> None:
    """List a namespace's topics."""
    _run(lambda c: c.namespace_topics(namespace), output, f"topics of {namespace}")


@namespaces_app.command("set-deduplication")
def namespaces_set_dedup(
    namespace: str,
    enable: Annotated[bool, typer.Option("--enable/--disable")] = True,
    output: OutputOpt = None,
) -> None:
    """Enable or disable deduplication for a namespace."""
    _run(lambda c: c.set_deduplication(namespace, enable), output,
         f"deduplication {'enabled' if enable else 'disabled'} on {namespace}")  # fmt: skip


@namespaces_app.command("set-scalable-topics")
def namespaces_set_scalable(
    namespace: str,
    enable: Annotated[bool, typer.Option("--enable/--disable")] = True,
    remove: Annotated[bool, typer.Option("--remove", help="use the broker's setting")] = False,
    output: OutputOpt = None,
) -> None:
    """Enable or disable scalable (topic://) topics in a namespace."""
    state = "reset to the broker's setting" if remove else ("enabled" if enable else "disabled")
    _run(lambda c: c.set_scalable_topic_enabled(namespace, None if remove else enable),
         output, f"scalable topics {state} on {namespace}")  # fmt: skip


@namespaces_app.command("get-scalable-topics")
def namespaces_get_scalable(namespace: str, output: OutputOpt = None) -> None:
    """Are scalable (topic://) topics enabled in a namespace?"""
    _run(lambda c: c.get_scalable_topic_enabled(namespace), output,
         f"scalable topics of {namespace}")  # fmt: skip


@namespaces_app.command("get-deduplication")
def namespaces_get_dedup(namespace: str, output: OutputOpt = None) -> None:
    """Is deduplication enabled for a namespace?"""
    _run(lambda c: c.get_deduplication(namespace), output, f"deduplication of {namespace}")


@namespaces_app.command("set-subscription-expiration-time")
def namespaces_set_sub_expiry(
    namespace: str,
    minutes: Annotated[
        int, typer.Option("--time", "-t", help="Minutes without a consumer (0: never).")
    ],
    output: OutputOpt = None,
) -> None:
    """Delete durable subscriptions left without a consumer this long."""
    if minutes < 0:
        raise typer.BadParameter("the expiration time is minutes >= 0")
    _run(lambda c: c.set_subscription_expiration_time(namespace, minutes), output,
         f"subscription expiration time of {namespace} set")  # fmt: skip


@namespaces_app.command("get-subscription-expiration-time")
def namespaces_get_sub_expiry(namespace: str, output: OutputOpt = None) -> None:
    """The subscription expiration time in minutes (null: the broker's)."""
    _run(lambda c: c.get_subscription_expiration_time(namespace), output,
         f"subscription expiration time of {namespace}")  # fmt: skip


@namespaces_app.command("remove-subscription-expiration-time")
def namespaces_remove_sub_expiry(namespace: str, output: OutputOpt = None) -> None:
    """Remove the namespace's subscription expiration time (the broker's applies)."""
    _run(lambda c: c.remove_subscription_expiration_time(namespace), output,
         f"subscription expiration time of {namespace} removed")  # fmt: skip


_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def parse_size(text: str) -> int:
    """pulsar-admin's size argument in bytes: ``-1``, ``4096``, ``10M``, ``2G``.

    Example:
        >>> parse_size("10M"), parse_size("-1"), parse_size("512k")
        (10485760, -1, 524288)
    """
    value = text.strip().upper()
    if value == "-1":
        return -1
    unit = value[-1] if value and value[-1] in "KMGT" else ""
    try:
        number = int(value[: len(value) - len(unit)])
    except ValueError:
        raise typer.BadParameter(f"not a size: {text!r} (e.g. 500M, 2G, -1)") from None
    if number < 0:
        raise typer.BadParameter(f"a size is -1 or >= 0: {text!r}")
    return number * _SIZE_UNITS[unit]


def parse_time_s(text: str) -> int:
    """pulsar-admin's time argument in seconds: ``-1``, ``120`` (s), ``30m``, ``3h``, ``2d``.

    Example:
        >>> parse_time_s("3h"), parse_time_s("90"), parse_time_s("-1")
        (10800, 90, -1)
    """
    value = text.strip().lower()
    if value == "-1":
        return -1
    unit = value[-1] if value and value[-1] in _TIME_UNITS else "s"
    digits = value[:-1] if value and value[-1] in _TIME_UNITS else value
    try:
        number = int(digits)
    except ValueError:
        raise typer.BadParameter(f"not a time: {text!r} (e.g. 30m, 3h, 2d, -1)") from None
    if number < 0:
        raise typer.BadParameter(f"a time is -1 or >= 0: {text!r}")
    return number * _TIME_UNITS[unit]


QuotaTypeOpt = Annotated[
    str, typer.Option("--type", "-t", help="destination_storage or message_age")
]
PolicyOpt = Annotated[
    str,
    typer.Option(
        "--policy",
        "-p",
        help="producer_request_hold, producer_exception or consumer_backlog_eviction",
    ),
]


Target = Annotated[str, typer.Argument(metavar="NAMESPACE|TOPIC", help="tenant/ns or a topic")]


def _policy_commands(app: typer.Typer) -> None:
    """Register pulsar-admin's retention, message-TTL and backlog-quota commands on ``app``
    (``namespaces``: a namespace's policies; ``topics``: a topic's overrides)."""

    @app.command("set-retention")
    def set_retention(
        target: Target,
        size: Annotated[str, typer.Option("--size", "-s", help="e.g. 500M, 2G; -1 unbounded")],
        time: Annotated[str, typer.Option("--time", "-t", help="e.g. 30m, 3h, 2d; -1 unbounded")],
        output: OutputOpt = None,
    ) -> None:
        """Set how long/much consumed data is kept (0 0: none, Pulsar's default)."""
        size_b, time_s = parse_size(size), parse_time_s(time)
        size_mb = -1 if size_b == -1 else size_b // (1024 * 1024)
        minutes = -1 if time_s == -1 else time_s // 60
        _run(lambda c: c.set_retention(target, minutes, size_mb), output,
             f"retention of {target} set")  # fmt: skip

    @app.command("get-retention")
    def get_retention(target: Target, output: OutputOpt = None) -> None:
        """Retention (minutes, MB)."""
        _run(lambda c: c.get_retention(target), output, f"retention of {target}")

    @app.command("remove-retention")
    def remove_retention(target: Target, output: OutputOpt = None) -> None:
        """Remove the retention policy (the next level's applies)."""
        _run(lambda c: c.remove_retention(target), output, f"retention of {target} removed")

    @app.command("set-message-ttl")
    def set_message_ttl(
        target: Target,
        ttl: Annotated[str, typer.Option("--messageTTL", "--ttl", "-ttl", help="e.g. 3600, 1h")],
        output: OutputOpt = None,
    ) -> None:
        """Set the message TTL (0: off)."""
        seconds = parse_time_s(ttl)
        _run(lambda c: c.set_message_ttl(target, seconds), output,
             f"message TTL of {target} set")  # fmt: skip

    @app.command("get-message-ttl")
    def get_message_ttl(target: Target, output: OutputOpt = None) -> None:
        """The message TTL in seconds (null: unset)."""
        _run(lambda c: c.get_message_ttl(target), output, f"message TTL of {target}")

    @app.command("remove-message-ttl")
    def remove_message_ttl(target: Target, output: OutputOpt = None) -> None:
        """Remove the message TTL."""
        _run(lambda c: c.remove_message_ttl(target), output, f"message TTL of {target} removed")

    @app.command("set-backlog-quota")
    def set_backlog_quota(
        target: Target,
        *,
        policy: PolicyOpt,
        limit: Annotated[str, typer.Option("--limit", "-l", help="size, e.g. 2G")] = "-1",
        limit_time: Annotated[str, typer.Option("--limitTime", "-lt", help="e.g. 1h")] = "-1",
        quota_type: QuotaTypeOpt = "destination_storage",
        output: OutputOpt = None,
    ) -> None:
        """Set a backlog quota."""
        size_b, time_s = parse_size(limit), parse_time_s(limit_time)
        _run(lambda c: c.set_backlog_quota(target, limit_size=size_b, limit_time_s=time_s,
                                           policy=policy, quota_type=quota_type),
             output, f"{quota_type} backlog quota of {target} set")  # fmt: skip

    @app.command("get-backlog-quotas")
    def get_backlog_quotas(target: Target, output: OutputOpt = None) -> None:
        """Backlog quotas by type."""
        _run(lambda c: c.get_backlog_quotas(target), output, f"backlog quotas of {target}")

    @app.command("remove-backlog-quota")
    def remove_backlog_quota(
        target: Target, quota_type: QuotaTypeOpt = "destination_storage", output: OutputOpt = None
    ) -> None:
        """Remove a backlog quota."""
        _run(lambda c: c.remove_backlog_quota(target, quota_type), output,
             f"{quota_type} backlog quota of {target} removed")  # fmt: skip

    @app.command("set-inactive-topic-policies")
    def set_inactive_topic_policies(
        target: Target,
        *,
        enable: Annotated[
            bool,
            typer.Option(
                "--enable-delete-while-inactive/--disable-delete-while-inactive",
                "-e/-d",
                help="Delete unused topics (or keep them).",
            ),
        ],
        duration: Annotated[
            str, typer.Option("--max-inactive-duration", "-t", help="e.g. 30m, 1h")
        ] = "60",
        mode: Annotated[
            str,
            typer.Option(
                "--delete-mode",
                "-m",
                help="delete_when_no_subscriptions or delete_when_subscriptions_caught_up",
            ),
        ] = "delete_when_no_subscriptions",
        output: OutputOpt = None,
    ) -> None:
        """Set when unused topics are deleted."""
        seconds = parse_time_s(duration)
        _run(lambda c: c.set_inactive_topic_policies(
                 target, delete_while_inactive=enable, max_inactive_duration_s=seconds, mode=mode),
             output, f"inactive topic policies of {target} set")  # fmt: skip

    @app.command("get-inactive-topic-policies")
    def get_inactive_topic_policies(
        target: Target,
        applied: Annotated[bool, typer.Option(help="The policy in force on a topic.")] = False,
        output: OutputOpt = None,
    ) -> None:
        """The inactive topic policies (null: unset)."""
        _run(lambda c: c.get_inactive_topic_policies(target, applied=applied), output,
             f"inactive topic policies of {target}")  # fmt: skip

    @app.command("remove-inactive-topic-policies")
    def remove_inactive_topic_policies(target: Target, output: OutputOpt = None) -> None:
        """Remove the inactive topic policies (the next level's apply)."""
        _run(lambda c: c.remove_inactive_topic_policies(target), output,
             f"inactive topic policies of {target} removed")  # fmt: skip

    @app.command("set-publish-rate")
    def set_publish_rate(
        target: Target,
        messages: Annotated[
            int, typer.Option("--msg-publish-rate", "-m", help="Messages/s (-1: no limit).")
        ] = -1,
        size: Annotated[
            int, typer.Option("--byte-publish-rate", "-b", help="Bytes/s (-1: no limit).")
        ] = -1,
        output: OutputOpt = None,
    ) -> None:
        """Set how fast producers may publish to a topic (each topic of a namespace)."""
        _run(lambda c: c.set_publish_rate(target, messages=messages, size=size), output,
             f"publish rate of {target} set")  # fmt: skip

    @app.command("get-publish-rate")
    def get_publish_rate(
        target: Target,
        applied: Annotated[bool, typer.Option(help="The rate in force on a topic.")] = False,
        output: OutputOpt = None,
    ) -> None:
        """The publish rate (null: unset)."""
        _run(lambda c: c.get_publish_rate(target, applied=applied), output,
             f"publish rate of {target}")  # fmt: skip

    @app.command("remove-publish-rate")
    def remove_publish_rate(target: Target, output: OutputOpt = None) -> None:
        """Remove the publish rate (the next level's applies)."""
        _run(lambda c: c.remove_publish_rate(target), output,
             f"publish rate of {target} removed")  # fmt: skip

    for prefix, per_subscription in (("", False), ("subscription-", True)):
        _dispatch_rate_commands(app, prefix, per_subscription)

    @app.command("set-subscribe-rate")
    def set_subscribe_rate(
        target: Target,
        per_consumer: Annotated[
            int, typer.Option("--subscribe-rate", "-sr", help="Subscribes (-1: no limit).")
        ] = -1,
        period: Annotated[
            int, typer.Option("--subscribe-rate-period", "-st", help="Seconds per period.")
        ] = 30,
        output: OutputOpt = None,
    ) -> None:
        """Set how often one consumer may subscribe to a topic (each topic of a namespace)."""
        _run(lambda c: c.set_subscribe_rate(target, per_consumer=per_consumer, period_s=period),
             output, f"subscribe rate of {target} set")  # fmt: skip

    @app.command("get-subscribe-rate")
    def get_subscribe_rate(
        target: Target,
        applied: Annotated[bool, typer.Option(help="The rate in force on a topic.")] = False,
        output: OutputOpt = None,
    ) -> None:
        """The subscribe rate (null: unset)."""
        _run(lambda c: c.get_subscribe_rate(target, applied=applied), output,
             f"subscribe rate of {target}")  # fmt: skip

    @app.command("remove-subscribe-rate")
    def remove_subscribe_rate(target: Target, output: OutputOpt = None) -> None:
        """Remove the subscribe rate (the next level's applies)."""
        _run(lambda c: c.remove_subscribe_rate(target), output,
             f"subscribe rate of {target} removed")  # fmt: skip


def _dispatch_rate_commands(app: typer.Typer, prefix: str, per_subscription: bool) -> None:
    """pulsar-admin's ``set-``/``get-``/``remove-[subscription-]dispatch-rate``."""
    noun = ("each subscription's" if per_subscription else "the topic's") + " dispatch rate"

    def set_rate(
        target: Target,
        messages: Annotated[
            int, typer.Option("--msg-dispatch-rate", "-md", help="Messages (-1: no limit).")
        ] = -1,
        size: Annotated[
            int, typer.Option("--byte-dispatch-rate", "-bd", help="Bytes (-1: no limit).")
        ] = -1,
        period: Annotated[
            int, typer.Option("--dispatch-rate-period", "-dt", help="Seconds per period.")
        ] = 1,
        output: OutputOpt = None,
    ) -> None:
        _run(lambda c: c.set_dispatch_rate(target, subscription=per_subscription,
                                           messages=messages, size=size, period_s=period),
             output, f"{noun} of {target} set")  # fmt: skip

    def get_rate(
        target: Target,
        applied: Annotated[bool, typer.Option(help="The rate in force on a topic.")] = False,
        output: OutputOpt = None,
    ) -> None:
        _run(lambda c: c.get_dispatch_rate(target, subscription=per_subscription,
                                           applied=applied),
             output, f"{noun} of {target}")  # fmt: skip

    def remove_rate(target: Target, output: OutputOpt = None) -> None:
        _run(lambda c: c.remove_dispatch_rate(target, subscription=per_subscription), output,
             f"{noun} of {target} removed")  # fmt: skip

    app.command(f"set-{prefix}dispatch-rate", help=f"Set {noun}.")(set_rate)
    app.command(f"get-{prefix}dispatch-rate", help=f"Get {noun} (null: unset).")(get_rate)
    app.command(f"remove-{prefix}dispatch-rate", help=f"Remove {noun}.")(remove_rate)


_policy_commands(namespaces_app)
_policy_commands(topics_app)


def _cap_commands(app: typer.Typer, cli_name: str, rest_name: str, letter: str) -> None:
    """pulsar-admin's ``set-``/``get-``/``remove-<cli_name>`` of one per-topic cap."""
    noun = cli_name.replace("-", " ")
    # A default, not an Annotated alias: the option's name is only known here, and the
    # annotations (strings under ``from __future__``) resolve in the module's globals.
    value_option = typer.Option(..., f"--{cli_name}", f"-{letter}", help="0: no cap")

    def set_cap(target: Target, value: int = value_option, output: OutputOpt = None) -> None:
        if value < 0:
            raise typer.BadParameter(f"{noun} must be 0 or more")
        _run(lambda c: c.set_cap(target, rest_name, value), output, f"{noun} of {target} set")

    def get_cap(
        target: Target,
        applied: Annotated[bool, typer.Option(help="The cap in force on a topic.")] = False,
        output: OutputOpt = None,
    ) -> None:
        _run(lambda c: c.get_cap(target, rest_name, applied=applied), output,
             f"{noun} of {target}")  # fmt: skip

    def remove_cap(target: Target, output: OutputOpt = None) -> None:
        _run(lambda c: c.remove_cap(target, rest_name), output, f"{noun} of {target} removed")

    app.command(f"set-{cli_name}", help=f"Set the {noun} (0: none).")(set_cap)
    app.command(f"get-{cli_name}", help=f"The {noun} (null: unset).")(get_cap)
    app.command(f"remove-{cli_name}", help=f"Remove the {noun}.")(remove_cap)


for _cli, _rest, _letter in (
    ("max-producers-per-topic", "maxProducersPerTopic", "p"),
    ("max-consumers-per-topic", "maxConsumersPerTopic", "c"),
    ("max-consumers-per-subscription", "maxConsumersPerSubscription", "c"),
    ("max-subscriptions-per-topic", "maxSubscriptionsPerTopic", "m"),
    ("max-unacked-messages-per-consumer", "maxUnackedMessagesPerConsumer", "c"),
    ("max-unacked-messages-per-subscription", "maxUnackedMessagesPerSubscription", "c"),
):
    _cap_commands(namespaces_app, _cli, _rest, _letter)
for _cli, _rest, _letter in (
    ("max-producers", "maxProducers", "p"),
    ("max-consumers", "maxConsumers", "c"),
    ("max-consumers-per-subscription", "maxConsumersPerSubscription", "c"),
    ("max-subscriptions-per-topic", "maxSubscriptionsPerTopic", "m"),
    ("max-unacked-messages-on-consumer", "maxUnackedMessagesOnConsumer", "m"),
    ("max-unacked-messages-on-subscription", "maxUnackedMessagesOnSubscription", "m"),
):
    _cap_commands(topics_app, _cli, _rest, _letter)


# --- topics -----------------------------------------------------------------------------------


@topics_app.command("list")
def topics_list(namespace: str, output: OutputOpt = None) -> None:
    """List topics: persistent (partitions included), then non-persistent ones loaded."""
    _run(lambda c: c.list_topics(namespace), output, f"topics of {namespace}")


@topics_app.command("list-partitioned")
def topics_list_partitioned(namespace: str, output: OutputOpt = None) -> None:
    """List partitioned topics."""
    _run(lambda c: c.list_partitioned_topics(namespace), output, f"partitioned in {namespace}")


@topics_app.command("create")
def topics_create(
    topic: str,
    partitions: Annotated[int, typer.Option(help="0: non-partitioned.")] = 0,
    output: OutputOpt = None,
) -> None:
    """Create a topic (partitioned with --partitions N)."""

    async def call(c: AdminClient) -> None:
        if partitions > 0:
            await c.create_partitioned_topic(topic, partitions)
        else:
            await c.create_topic(topic)

    _run(call, output, f"created {topic}")


@topics_app.command("delete")
def topics_delete(topic: str, force: ForceOpt = False, output: OutputOpt = None) -> None:
    """Delete a topic (with all its partitions when partitioned)."""

    async def call(c: AdminClient) -> None:
        if await c.get_partitions(topic) > 0:
            await c.delete_partitioned_topic(topic, force=force)
        else:
            await c.delete_topic(topic, force=force)

    _run(call, output, f"deleted {topic}")


@topics_app.command("partitions")
def topics_partitions(topic: str, output: OutputOpt = None) -> None:
    """Show the partition count (0: not partitioned)."""

    async def call(c: AdminClient) -> Any:
        return {"partitions": await c.get_partitions(topic)}

    _run(call, output, topic)


@topics_app.command("update-partitions")
def topics_update_partitions(topic: str, partitions: int, output: OutputOpt = None) -> None:
    """Increase the number of partitions."""
    _run(lambda c: c.update_partitioned_topic(topic, partitions), output,
         f"{topic} now has {partitions} partitions")  # fmt: skip


@topics_app.command("stats")
def topics_stats(topic: str, output: OutputOpt = None) -> None:
    """Topic stats (partitioned topics: summed over partitions)."""

    async def call(c: AdminClient) -> Any:
        if await c.get_partitions(topic) > 0:
            return await c.partitioned_stats(topic)
        return await c.stats(topic)

    _run(call, output, f"stats of {topic}")


@topics_app.command("internal-stats")
def topics_internal_stats(topic: str, output: OutputOpt = None) -> None:
    """Managed-ledger internal stats."""
    _run(lambda c: c.internal_stats(topic), output, f"internal stats of {topic}")


@topics_app.command("terminate")
def topics_terminate(topic: str, output: OutputOpt = None) -> None:
    """Terminate (seal) a topic; prints its last message id."""
    _run(lambda c: c.terminate(topic), output, f"terminated {topic}")


@topics_app.command("lookup")
def topics_lookup(topic: str, output: OutputOpt = None) -> None:
    """Which broker serves a topic."""
    _run(lambda c: c.lookup(topic), output, f"lookup of {topic}")


@topics_app.command("subscriptions")
def topics_subscriptions(topic: str, output: OutputOpt = None) -> None:
    """List a topic's subscriptions."""
    _run(lambda c: c.subscriptions(topic), output, f"subscriptions of {topic}")


@topics_app.command("create-subscription")
def topics_create_subscription(
    topic: str,
    subscription: str,
    position: Annotated[str, typer.Option(help="earliest, latest or ledger:entry")] = "latest",
    output: OutputOpt = None,
) -> None:
    """Create a subscription at a position."""
    start = _message_id(position)
    _run(lambda c: c.create_subscription(topic, subscription, start), output,
         f"created subscription {subscription}")  # fmt: skip


@topics_app.command("delete-subscription")
def topics_delete_subscription(
    topic: str, subscription: str, force: ForceOpt = False, output: OutputOpt = None
) -> None:
    """Delete a subscription."""
    _run(lambda c: c.delete_subscription(topic, subscription, force=force), output,
         f"deleted subscription {subscription}")  # fmt: skip


@topics_app.command("skip")
def topics_skip(
    topic: str,
    subscription: str,
    count: Annotated[int | None, typer.Option(help="Messages to skip (default: all).")] = None,
    output: OutputOpt = None,
) -> None:
    """Skip N messages, or the whole backlog."""

    async def call(c: AdminClient) -> None:
        if count is None:
            await c.skip_all(topic, subscription)
        else:
            await c.skip(topic, subscription, count)

    _run(call, output, f"skipped on {subscription}")


@topics_app.command("reset-cursor")
def topics_reset_cursor(
    topic: str,
    subscription: str,
    time_ms: Annotated[int | None, typer.Option("--time", help="Publish time (ms).")] = None,
    message_id: Annotated[str | None, typer.Option(help="ledger:entry")] = None,
    output: OutputOpt = None,
) -> None:
    """Move a subscription to a publish time or a message id."""
    if (time_ms is None) == (message_id is None):
        raise typer.BadParameter("give exactly one of --time and --message-id")

    async def call(c: AdminClient) -> None:
        if time_ms is not None:
            await c.reset_cursor_to_time(topic, subscription, time_ms)
        else:
            assert message_id is not None
            ledger, entry = _message_id(message_id)
            await c.reset_cursor(topic, subscription, ledger, entry)

    _run(call, output, f"reset {subscription}")


# --- scalable topics --------------------------------------------------------------------------


class DagFormat(StrEnum):
    tree = "tree"
    dot = "dot"


def _epochs(segment: Segment) -> str:
    text = f"created@{segment.created_at_epoch}"
    if not segment.is_active:
        text += f" sealed@{segment.sealed_at_epoch}"
    return text


def _segment_label(segment: Segment) -> str:
    """``<id> <start>-<end> <STATE> created@E [sealed@E]`` (plain text)."""
    return (
        f"{segment.segment_id} {segment.hash_range.to_hex()} {segment.state.value} "
        f"{_epochs(segment)}"
    )


def dag_tree(topic: str, layout: SegmentLayout) -> Tree:
    """The DAG as a rich tree: roots, then each segment's children under it. A merged child
    sits under each of its parents; its subtree is drawn once (later: "see above")."""
    tree = Tree(f"[bold]{escape(topic)}[/] epoch {layout.epoch}")
    drawn: set[int] = set()

    def add(parent: Tree, segment: Segment) -> None:
        color = "green" if segment.is_active else "dim"
        label = f"[{color}]{_segment_label(segment)}[/]"
        if segment.segment_id in drawn:
            parent.add(label + " [dim](see above)[/]")
            return
        drawn.add(segment.segment_id)
        node = parent.add(label)
        for child in sorted(layout.children(segment.segment_id), key=lambda s: s.segment_id):
            add(node, child)

    for root in sorted(layout.roots, key=lambda s: s.hash_range.start):
        add(tree, root)
    return tree


def dag_dot(topic: str, layout: SegmentLayout) -> str:
    """The DAG as Graphviz dot text: one node per segment, one edge per parent->child link."""
    lines = [f"digraph {json.dumps(topic)} {{", "  rankdir=TB;", "  node [shape=box];"]
    for segment in sorted(layout, key=lambda s: s.segment_id):
        label = (
            f"{segment.segment_id}\\n{segment.hash_range.to_hex()}\\n"
            f"{segment.state.value}\\n{_epochs(segment)}"
        )
        style = "" if segment.is_active else ", style=dashed"
        lines.append(f'  "{segment.segment_id}" [label="{label}"{style}];')
    for segment in sorted(layout, key=lambda s: s.segment_id):
        for child_id in segment.child_ids:
            lines.append(f'  "{segment.segment_id}" -> "{child_id}";')
    lines.append("}")
    return "\n".join(lines)


def _layout_table(topic: str, layout: SegmentLayout) -> Table:
    table = Table(title=f"{escape(topic)} epoch {layout.epoch}")
    for column in ("id", "range", "state", "created", "sealed", "parents", "children"):
        table.add_column(column)
    for s in sorted(layout, key=lambda s: s.segment_id):
        table.add_row(
            str(s.segment_id),
            s.hash_range.to_hex(),
            s.state.value,
            str(s.created_at_epoch),
            "" if s.is_active else str(s.sealed_at_epoch),
            ",".join(map(str, s.parent_ids)),
            ",".join(map(str, s.child_ids)),
        )
    return table


def _print_layout(topic: str, data: Any, output: Output | None) -> None:
    if (output or _settings.output) is Output.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        stdout.print(_layout_table(topic, SegmentLayout.from_dict(data)))


@scalable_app.command("list")
def scalable_list(namespace: str, output: OutputOpt = None) -> None:
    """Scalable topics of a namespace."""
    _run(lambda c: c.list_scalable_topics(namespace), output, f"scalable topics of {namespace}")


@scalable_app.command("create")
def scalable_create(
    topic: str,
    segments: Annotated[
        int, typer.Option("--segments", "-s", min=1, help="Initial segment count.")
    ] = 1,
    output: OutputOpt = None,
) -> None:
    """Create a scalable topic with N initial segments."""
    _run(lambda c: c.create_scalable_topic(topic, segments), output, f"created {topic}")


@scalable_app.command("get")
def scalable_get(topic: str, output: OutputOpt = None) -> None:
    """The topic's segment layout."""
    _print_layout(topic, _call(lambda c: c.get_scalable_topic(topic)), output)


@scalable_app.command("delete")
def scalable_delete(topic: str, output: OutputOpt = None) -> None:
    """Delete a scalable topic and its segments."""
    _run(lambda c: c.delete_scalable_topic(topic), output, f"deleted {topic}")


@scalable_app.command("split")
def scalable_split(topic: str, segment_id: int, output: OutputOpt = None) -> None:
    """Split an active segment at its midpoint."""
    _print_layout(topic, _call(lambda c: c.split_segment(topic, segment_id)), output)


@scalable_app.command("merge")
def scalable_merge(topic: str, first_id: int, second_id: int, output: OutputOpt = None) -> None:
    """Merge two adjacent active segments."""
    _print_layout(topic, _call(lambda c: c.merge_segments(topic, first_id, second_id)), output)


@scalable_app.command("stats")
def scalable_stats(topic: str, output: OutputOpt = None) -> None:
    """Per-segment state, range, backlog and message counters; per subscription, which
    consumer holds which segments (shared ones in Key_Shared dispatch mode) and the grace
    time left of disconnected consumers."""
    data = _call(lambda c: c.scalable_stats(topic))
    if (output or _settings.output) is Output.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    table = Table(title=f"{escape(topic)} epoch {data.get('epoch')}")
    for column in ("id", "range", "state", "backlog", "msgIn", "msgOut", "rates", "intent"):
        table.add_column(column)
    for entry in data.get("segments", {}).values():
        backlog = entry.get("backlog", {})
        rates = entry.get("rates") or {}
        table.add_row(
            str(entry.get("segmentId")),
            str(entry.get("hashRange")),
            str(entry.get("state")),
            escape(", ".join(f"{sub}={n}" for sub, n in backlog.items())),
            str(entry.get("msgInCounter", "")),
            str(entry.get("msgOutCounter", "")),
            ", ".join(f"{k}={v:.0f}" for k, v in rates.items() if v),
            str(entry.get("intent", "")),
        )
    stdout.print(table)
    _print_subscription_states(topic, data.get("subscriptionStates", {}))


def _print_subscription_states(topic: str, states: dict[str, Any]) -> None:
    """One row per consumer of each subscription: its segments, whether it shares them
    (Key_Shared dispatch mode), and the grace time left of a disconnected one."""
    table = Table(title=f"{escape(topic)} assignments")
    for column in ("subscription", "type", "consumer", "state", "segments", "shared", "grace"):
        table.add_column(column)
    for sub, state in sorted(states.items()):
        if not state.get("leader"):
            table.add_row(escape(sub), "", "", "(state is on the controller leader)", "", "", "")
            continue
        shared = state.get("sharedSegments", {})
        for name, consumer in state.get("consumers", {}).items():
            segments = consumer.get("segments", [])
            grace = consumer.get("graceRemainingMs")
            table.add_row(
                escape(sub),
                str(state.get("type")),
                escape(name),
                "connected" if consumer.get("connected") else "disconnected",
                ", ".join(str(s) for s in segments),
                "yes" if any(str(s) in shared for s in segments) else "",
                "" if grace is None else f"{grace / 1000:.1f}s",
            )
        if not state.get("consumers"):
            table.add_row(escape(sub), str(state.get("type")), "", "no consumers", "", "", "")
    stdout.print(table)


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    """``name=value`` pairs to a JSON object (values parsed as JSON, else kept as text).

    Example:
        >>> parse_settings(["enabled=true", "maxSegments=8", "mergeLowWater=0.25"])
        {'enabled': True, 'maxSegments': 8, 'mergeLowWater': 0.25}
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"{pair!r} is not name=value")
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text
    return out


@scalable_app.command("get-autoscale")
def scalable_get_autoscale(
    target: str,
    applied: Annotated[bool, typer.Option(help="The whole policy in force there.")] = False,
    output: OutputOpt = None,
) -> None:
    """A namespace's (tenant/ns) or scalable topic's autoscale overrides."""
    _run(lambda c: c.get_scalable_autoscale(target, applied), output, f"autoscale of {target}")


@scalable_app.command("set-autoscale")
def scalable_set_autoscale(target: str, settings: list[str], output: OutputOpt = None) -> None:
    """Override autoscale settings: name=value ... (enabled, splitMsgRateIn,
    splitThroughputIn, splitMsgRateOut, splitThroughputOut, splitBacklog, minSegments,
    maxSegments, targetSegments, mergeLowWater, splitSustainMs, mergeSustainMs,
    splitCooldownMs, mergeCooldownMs)."""
    body = parse_settings(settings)
    _run(lambda c: c.set_scalable_autoscale(target, body), output, f"autoscale of {target} set")


@scalable_app.command("remove-autoscale")
def scalable_remove_autoscale(target: str, output: OutputOpt = None) -> None:
    """Remove the level's autoscale overrides (the next level's apply)."""
    _run(lambda c: c.remove_scalable_autoscale(target), output, f"autoscale of {target} removed")


@scalable_app.command("subscriptions")
def scalable_subscriptions(
    topic: str,
    create: Annotated[str | None, typer.Option("--create", help="Create this one.")] = None,
    delete: Annotated[str | None, typer.Option("--delete", help="Delete this one.")] = None,
    output: OutputOpt = None,
) -> None:
    """List the topic's subscriptions (after creating/deleting one if asked)."""

    async def call(c: AdminClient) -> list[str]:
        if create is not None:
            await c.create_scalable_subscription(topic, create)
        if delete is not None:
            await c.delete_scalable_subscription(topic, delete)
        return await c.scalable_subscriptions(topic)

    _run(call, output, f"subscriptions of {topic}")


@scalable_app.command("dag")
def scalable_dag(
    topic: str,
    fmt: Annotated[
        DagFormat, typer.Option("--format", "-f", help="tree (rich) or dot (Graphviz).")
    ] = DagFormat.tree,
) -> None:
    """Draw the segment DAG: a tree in the terminal, or Graphviz dot text."""
    layout = SegmentLayout.from_dict(_call(lambda c: c.get_scalable_topic(topic)))
    if fmt is DagFormat.dot:
        typer.echo(dag_dot(topic, layout))
    else:
        stdout.print(dag_tree(topic, layout))


# --- transactions -----------------------------------------------------------------------------

CoordinatorOpt = Annotated[
    int | None,
    typer.Option("--coordinator-id", min=0, help="Only this coordinator partition."),
]
_TXN_COUNTS = ("created", "committed", "aborted", "timedOut", "open")


def _json_out(data: Any, output: Output | None) -> bool:
    """Print ``data`` as JSON when that is the chosen output; True when printed."""
    if (output or _settings.output) is Output.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True))
        return True
    return False


def coordinator_table(data: dict[str, Any]) -> Table:
    """A row per coordinator partition and a total row (or the one partition asked for).

    Example:
        >>> coordinator_table({"partitions": 1, "created": 2, "perPartition": {}}).row_count
        1
    """
    per_partition: dict[str, Any] = data.get("perPartition", {})
    if "perPartition" not in data:  # one partition (--coordinator-id)
        per_partition = {str(data.get("coordinatorId", "?")): data}
    table = Table(title="transaction coordinator")
    for column in ("partition", "state", *_TXN_COUNTS):
        table.add_column(column)
    for key in sorted(per_partition, key=lambda k: int(k) if k.isdigit() else -1):
        entry = per_partition[key]
        table.add_row(
            key, str(entry.get("state", "")), *(str(entry.get(c, 0)) for c in _TXN_COUNTS)
        )
    if "perPartition" in data:
        table.add_row(
            f"total ({data.get('partitions', len(per_partition))})",
            f"gc {data.get('gcCollected', 0)}",
            *(str(data.get(c, 0)) for c in _TXN_COUNTS),
            style="bold",
        )
    return table


@transactions_app.command("coordinator-stats")
def transactions_coordinator_stats(
    coordinator_id: CoordinatorOpt = None, output: OutputOpt = None
) -> None:
    """Coordinator stats: created/committed/aborted/timed-out/open per partition."""
    data = _call(lambda c: c.coordinator_stats(coordinator_id))
    if not _json_out(data, output):
        stdout.print(coordinator_table(data))


@transactions_app.command("transaction-metadata")
def transactions_metadata(most_bits: int, least_bits: int, output: OutputOpt = None) -> None:
    """A transaction's status, timestamps and op records (MOST LEAST of its TxnID)."""
    _run(lambda c: c.transaction_metadata(most_bits, least_bits), output,
         f"transaction {most_bits}_{least_bits}")  # fmt: skip


@transactions_app.command("slow-transactions")
def transactions_slow(
    timeout_ms: Annotated[
        int, typer.Option("--timeout-ms", min=0, help="List OPEN transactions older than this.")
    ],
    coordinator_id: CoordinatorOpt = None,
    output: OutputOpt = None,
) -> None:
    """OPEN transactions created more than --timeout-ms milliseconds ago."""
    data = _call(lambda c: c.slow_transactions(timeout_ms, coordinator_id))
    if _json_out(data, output):
        return
    table = Table(title=f"transactions open longer than {timeout_ms} ms")
    for column in ("txnId", "status", "openTimestamp", "timeoutAt", "owner"):
        table.add_column(column)
    for txn_id, entry in data.items():
        table.add_row(
            txn_id,
            str(entry.get("status", "")),
            str(entry.get("openTimestamp", "")),
            str(entry.get("timeoutAt", "")),
            escape(str(entry.get("owner") or "")),
        )
    stdout.print(table)


@transactions_app.command("buffer-stats")
def transactions_buffer_stats(topic: str, output: OutputOpt = None) -> None:
    """A topic's transaction buffer (persistent topic or segment:// name)."""
    _run(lambda c: c.transaction_buffer_stats(topic), output, f"transaction buffer of {topic}")


@transactions_app.command("pending-ack-stats")
def transactions_pending_ack_stats(topic: str, subscription: str, output: OutputOpt = None) -> None:
    """A subscription's pending-ack store (persistent topic or segment:// name)."""
    _run(lambda c: c.pending_ack_stats(topic, subscription), output,
         f"pending acks of {subscription} on {topic}")  # fmt: skip


OwnerOpt = Annotated[
    str,
    typer.Option("--owner", help="The role that claimed the key (default: none, auth off)."),
]


def transaction_keys_table(keys: list[dict[str, Any]]) -> Table:
    """A row per transaction key.

    Example:
        >>> transaction_keys_table([{"transactionKey": "etl-7", "epoch": 2}]).row_count
        1
    """
    columns = ("owner", "transactionKey", "epoch", "txnId", "ageMs")
    table = Table(title="transaction keys")
    for column in columns:
        table.add_column(column)
    for entry in keys:
        table.add_row(*("-" if entry.get(c) is None else escape(str(entry[c])) for c in columns))
    return table


@transactions_app.command("list-transaction-keys")
def transactions_list_keys(output: OutputOpt = None) -> None:
    """Every transaction key with its epoch and last transaction."""
    data = _call(lambda c: c.list_transaction_keys())
    if not _json_out(data, output):
        stdout.print(transaction_keys_table(data))


@transactions_app.command("get-transaction-key")
def transactions_get_key(key: str, owner: OwnerOpt = "", output: OutputOpt = None) -> None:
    """A transaction key's epoch, current transaction (and status), owner and age."""
    _run(lambda c: c.get_transaction_key(key, owner=owner), output, f"transaction key {key}")


@transactions_app.command("delete-transaction-key")
def transactions_delete_key(key: str, owner: OwnerOpt = "", output: OutputOpt = None) -> None:
    """Abort a transaction key's open transaction and delete the key (fences its holder)."""
    _run(lambda c: c.delete_transaction_key(key, owner=owner), output,
         f"deleted transaction key {key}")  # fmt: skip
