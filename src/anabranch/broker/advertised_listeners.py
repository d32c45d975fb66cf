"""Advertised listeners (Pulsar's ``advertisedListeners``): a broker reachable under
several names, each with its own ``pulsar://`` and/or ``pulsar+ssl://`` URL, and lookups
that answer the URLs of the listener the client names. The internal listener's URLs are the
broker's own address (upstream's ``brokerServiceUrl``): what lookups naming no listener
answer, and what the cluster registry knows the broker by.

Configuration, as upstream writes it (``BrokerConfig.advertised_listeners``)::

    advertised_listeners = "internal:pulsar://10.0.0.1:6650,internal:pulsar+ssl://10.0.0.1:6651,external:pulsar://host:16650"
    internal_listener_name = "internal"   # default: the first listener named

or as a TOML table: ``[advertised_listeners]`` with ``internal = ["pulsar://...",
"pulsar+ssl://..."]``. The rules are upstream's ``MultipleListenerValidator``: each
listener has at most one ``pulsar://`` and one ``pulsar+ssl://`` URL (and at least one of
them), one ``host:port`` belongs to one listener only, and ``internal_listener_name``
must name one of them.

Lookups: LOOKUP with ``advertised_listener_name`` (the official clients' ``listener_name``)
and ``GET /lookup/v2/topic/...?listenerName=`` (or the ``X-Pulsar-ListenerName`` header)
answer that listener's URLs of the owning broker; a name the broker does not have is
refused with :class:`~anabranch.errors.ListenerNotFound` (ServiceNotReady, "the broker do
not have <name> listener", as upstream), never answered with the default URL. Without a
name, lookups answer as before. In a cluster each broker publishes its listeners in its
registry record (``BrokerRecord.advertised_listeners``), so any broker answers with the
owner's listener of that name.

Example:
    >>> ls = parse_listeners("internal:pulsar://10.0.0.1:6650,external:pulsar://h:1")
    >>> ls["external"].pulsar_url, ls["internal"].pulsar_url_tls
    ('pulsar://h:1', '')
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from anabranch.errors import InvalidArgument, ListenerNotFound

__all__ = [
    "Listener",
    "canonical_spec",
    "internal_listener_urls",
    "listener_urls",
    "parse_listeners",
]

_SCHEMES = ("pulsar", "pulsar+ssl")


@dataclass(frozen=True, slots=True)
class Listener:
    """One advertised listener's URLs ("" where it has none)."""

    pulsar_url: str = ""
    pulsar_url_tls: str = ""


def canonical_spec(value: str | Mapping[str, str | list[str]]) -> str:
    """Pulsar's comma-separated ``name:url`` form of a listener spec given as that string
    or as a table ``{name: url or [urls]}``.

    Example:
        >>> canonical_spec({"a": ["pulsar://h:1", "pulsar+ssl://h:2"]})
        'a:pulsar://h:1,a:pulsar+ssl://h:2'
    """
    if isinstance(value, str):
        return value.strip()
    parts = []
    for name, urls in value.items():
        for url in [urls] if isinstance(urls, str) else urls:
            parts.append(f"{name}:{url}")
    return ",".join(parts)


@functools.lru_cache(maxsize=16)
def parse_listeners(spec: str) -> dict[str, Listener]:
    """The listeners of ``spec`` by name, checked as upstream checks them
    (InvalidArgument otherwise). Cached: lookups consult it on every request.

    Example:
        >>> parse_listeners("")
        {}
        >>> parse_listeners("a:pulsar://h:1,b:pulsar://h:1")
        Traceback (most recent call last):
        ...
        anabranch.errors.InvalidArgument: h:1 is advertised by two listeners (a, b)
    """
    urls: dict[str, dict[str, str]] = {}
    owners: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, url = item.partition(":")
        if not sep or not name.strip() or not url:
            raise InvalidArgument(f"advertised listener {item!r} is not name:url")
        name = name.strip()
        try:
            parsed = urlsplit(url)
            port = parsed.port
        except ValueError as err:
            raise InvalidArgument(f"advertised listener {item!r}: {err}") from err
        if parsed.scheme not in _SCHEMES or not parsed.hostname or port is None:
            raise InvalidArgument(
                f"advertised listener {item!r}: want pulsar://host:port or pulsar+ssl://host:port"
            )
        mine = urls.setdefault(name, {})
        if parsed.scheme in mine:
            raise InvalidArgument(f"listener {name} has two {parsed.scheme}:// URLs")
        mine[parsed.scheme] = url
        host_port = f"{parsed.hostname}:{port}"
        other = owners.setdefault(host_port, name)
        if other != name:
            raise InvalidArgument(f"{host_port} is advertised by two listeners ({other}, {name})")
    return {
        name: Listener(mine.get("pulsar", ""), mine.get("pulsar+ssl", ""))
        for name, mine in urls.items()
    }


def internal_listener(spec: str, name: str) -> str:
    """The internal listener's name: ``name``, or the first listener of ``spec`` ("" when
    none is configured); InvalidArgument when ``name`` is not one of them.

    Example:
        >>> internal_listener("a:pulsar://h:1,b:pulsar://g:1", "")
        'a'
    """
    listeners = parse_listeners(spec)
    if not listeners:
        if name:
            raise InvalidArgument("internal_listener_name needs advertised_listeners")
        return ""
    if not name:
        return next(iter(listeners))
    if name not in listeners:
        raise InvalidArgument(f"internal_listener_name {name!r} is not an advertised listener")
    return name


def internal_listener_urls(config: Any) -> Listener | None:
    """The internal listener of a broker config (None without advertised listeners).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> cfg = NS(advertised_listeners="a:pulsar://h:1", internal_listener_name="a")
        >>> internal_listener_urls(cfg).pulsar_url
        'pulsar://h:1'
    """
    listeners = parse_listeners(str(getattr(config, "advertised_listeners", "") or ""))
    return listeners.get(str(getattr(config, "internal_listener_name", "") or ""))


def listener_urls(listeners: Mapping[str, Listener], name: str) -> Listener:
    """The listener called ``name`` (ListenerNotFound when there is none).

    Example:
        >>> listener_urls({"a": Listener("pulsar://h:1")}, "a").pulsar_url
        'pulsar://h:1'
    """
    listener = listeners.get(name)
    if listener is None:
        raise ListenerNotFound(name)
    return listener


def record_form(listeners: Mapping[str, Listener]) -> dict[str, list[str]]:
    """How a broker publishes its listeners in its registry record.

    Example:
        >>> record_form({"a": Listener("pulsar://h:1", "")})
        {'a': ['pulsar://h:1']}
    """
    return {
        name: [url for url in (lst.pulsar_url, lst.pulsar_url_tls) if url]
        for name, lst in listeners.items()
    }


def from_record(published: Mapping[str, list[str]]) -> dict[str, Listener]:
    """The listeners a registry record publishes (see :func:`record_form`).

    Example:
        >>> from_record({"a": ["pulsar://h:1", "pulsar+ssl://h:2"]})["a"].pulsar_url_tls
        'pulsar+ssl://h:2'
    """
    return parse_listeners(canonical_spec(dict(published)))
