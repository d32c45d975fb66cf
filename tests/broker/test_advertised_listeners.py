"""The advertised-listener spec as properties: what a broker publishes in its registry
record reads back as the listeners it was configured with."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from anabranch.broker.advertised_listeners import (
    Listener,
    canonical_spec,
    from_record,
    listener_urls,
    parse_listeners,
    record_form,
)
from anabranch.errors import ListenerNotFound

names = st.text(alphabet="abcdefghij-_", min_size=1, max_size=8)


@st.composite
def listener_sets(draw: st.DrawFn) -> dict[str, Listener]:
    chosen = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    out = {}
    for index, name in enumerate(chosen):
        plain, tls = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
        out[name] = Listener(
            f"pulsar://h{index}:{6650 + index}" if plain else "",
            f"pulsar+ssl://h{index}:{7650 + index}" if tls else "",
        )
    return out


@given(listener_sets())
def test_published_listeners_read_back(listeners: dict[str, Listener]) -> None:
    spec = canonical_spec(record_form(listeners))
    assert parse_listeners(spec) == listeners
    assert from_record(record_form(listeners)) == listeners
    for name, listener in listeners.items():
        assert listener_urls(listeners, name) == listener


@given(listener_sets(), names)
def test_an_unknown_name_is_never_answered_with_another(
    listeners: dict[str, Listener], name: str
) -> None:
    if name in listeners:
        return
    try:
        listener_urls(listeners, name)
    except ListenerNotFound as err:
        assert err.name == name
    else:
        raise AssertionError("an unknown listener was answered")
