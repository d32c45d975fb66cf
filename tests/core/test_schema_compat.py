"""Avro schema resolution and Pulsar's compatibility strategies, against a small model:
generated schemas, evolutions whose answer is known (a field added with or without a
default, a numeric promotion), and the lattice the strategies form."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anabranch.core.schema_compat import (
    PRIMITIVES,
    Incompatible,
    InvalidAvroSchema,
    Strategy,
    can_read,
    check_compatible,
    parse_avro,
)

# writer → readers that can read it (the Avro specification's promotions), the model.
READABLE_AS = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "double": {"double"},
    "string": {"string", "bytes"},
    "bytes": {"bytes", "string"},
    "boolean": {"boolean"},
    "null": {"null"},
}


@st.composite
def avro_types(draw: st.DrawFn, depth: int = 0, names: list[int] | None = None) -> Any:
    """A random Avro type document; record/enum names unique within one schema."""
    names = names if names is not None else [0]
    kinds = ["primitive"] if depth >= 3 else ["primitive", "array", "map", "record", "enum"]
    kind = draw(st.sampled_from(kinds))
    if kind == "primitive":
        return draw(st.sampled_from(sorted(PRIMITIVES)))
    if kind == "array":
        return {"type": "array", "items": draw(avro_types(depth + 1, names))}
    if kind == "map":
        return {"type": "map", "values": draw(avro_types(depth + 1, names))}
    names[0] += 1
    if kind == "enum":
        symbols = draw(st.lists(st.sampled_from("ABCDE"), min_size=1, max_size=4, unique=True))
        return {"type": "enum", "name": f"E{names[0]}", "symbols": symbols}
    name = f"R{names[0]}"
    count = draw(st.integers(0, 3))
    fields = [{"name": f"f{i}", "type": draw(avro_types(depth + 1, names))} for i in range(count)]
    return {"type": "record", "name": name, "fields": fields}


def record_docs() -> st.SearchStrategy[Any]:
    return avro_types().filter(lambda d: isinstance(d, dict) and d["type"] == "record")


def text(doc: Any) -> str:
    return json.dumps(doc)


@given(avro_types())
def test_every_schema_reads_its_own_data(doc: Any) -> None:
    parsed = parse_avro(text(doc))
    assert can_read(parsed, parsed)


@given(record_docs(), st.sampled_from(sorted(PRIMITIVES)))
def test_a_field_added_with_a_default_is_fully_compatible(doc: Any, kind: str) -> None:
    new = dict(doc, fields=[*doc["fields"], {"name": "added", "type": kind, "default": None}])
    old_p, new_p = parse_avro(text(doc)), parse_avro(text(new))
    assert can_read(new_p, old_p) and can_read(old_p, new_p)
    check_compatible(Strategy.FULL_TRANSITIVE, [text(doc)], text(new))


@given(record_docs(), st.sampled_from(sorted(PRIMITIVES)))
def test_a_field_added_without_a_default_is_only_forward_compatible(doc: Any, kind: str) -> None:
    new = dict(doc, fields=[*doc["fields"], {"name": "added", "type": kind}])
    assert not can_read(parse_avro(text(new)), parse_avro(text(doc)))
    assert can_read(parse_avro(text(doc)), parse_avro(text(new)))  # old readers skip it
    check_compatible(Strategy.FORWARD, [text(doc)], text(new))
    with pytest.raises(Incompatible, match="BACKWARD"):
        check_compatible(Strategy.BACKWARD, [text(doc)], text(new))


@pytest.mark.parametrize(("writer", "reader"), list(itertools.product(READABLE_AS, repeat=2)))
def test_primitive_promotions_match_the_specification(writer: str, reader: str) -> None:
    w = parse_avro(text({"type": "record", "name": "R", "fields": [{"name": "x", "type": writer}]}))
    r = parse_avro(text({"type": "record", "name": "R", "fields": [{"name": "x", "type": reader}]}))
    assert can_read(r, w) == (reader in READABLE_AS[writer])


@settings(max_examples=60)
@given(st.lists(avro_types(), min_size=1, max_size=4), avro_types())
def test_strategies_form_a_lattice(history: list[Any], new: Any) -> None:
    old = [text(d) for d in history]

    def passes(strategy: Strategy) -> bool:
        try:
            check_compatible(strategy, old, text(new))
        except Incompatible:
            return False
        return True

    outcome: dict[Strategy, bool] = {s: passes(s) for s in Strategy if s is not Strategy.UNDEFINED}
    assert outcome[Strategy.ALWAYS_COMPATIBLE]
    assert not outcome[Strategy.ALWAYS_INCOMPATIBLE]
    assert outcome[Strategy.FULL] == (outcome[Strategy.BACKWARD] and outcome[Strategy.FORWARD])
    for plain in ("BACKWARD", "FORWARD", "FULL"):
        if outcome[Strategy(f"{plain}_TRANSITIVE")]:
            assert outcome[Strategy(plain)]
    latest = parse_avro(old[-1])
    assert outcome[Strategy.BACKWARD] == can_read(parse_avro(text(new)), latest)


def test_transitive_strategies_check_every_version() -> None:
    def user(*fields: dict[str, Any]) -> str:
        return text({"type": "record", "name": "User", "fields": list(fields)})

    v1 = user({"name": "a", "type": "int"})
    v2 = user({"name": "a", "type": "int", "default": 0}, {"name": "b", "type": "int"})
    v3 = user({"name": "b", "type": "int"})  # reads v2 data, not v1 data (no b there)
    check_compatible(Strategy.BACKWARD, [v1, v2], v3)
    with pytest.raises(Incompatible):
        check_compatible(Strategy.BACKWARD_TRANSITIVE, [v1, v2], v3)


def test_enums_unions_fixed_and_recursive_records_resolve() -> None:
    def enum(*symbols: str, default: str | None = None) -> Any:
        doc: dict[str, Any] = {"type": "enum", "name": "Color", "symbols": list(symbols)}
        if default is not None:
            doc["default"] = default
        return doc

    assert can_read(parse_avro(text(enum("R", "G", "B"))), parse_avro(text(enum("R", "G"))))
    assert not can_read(parse_avro(text(enum("R"))), parse_avro(text(enum("R", "G"))))
    assert can_read(parse_avro(text(enum("R", "X", default="X"))), parse_avro(text(enum("G"))))
    union = parse_avro('["null", "string"]')
    assert can_read(union, parse_avro('"string"'))
    assert not can_read(parse_avro('"string"'), union)  # the writer may have written null
    fixed = {"type": "fixed", "name": "F", "size": 4}
    assert not can_read(parse_avro(text(dict(fixed, size=8))), parse_avro(text(fixed)))
    linked = {
        "type": "record", "name": "Node",
        "fields": [{"name": "v", "type": "int"}, {"name": "next", "type": ["null", "Node"]}],
    }  # fmt: skip
    widened = json.loads(text(linked))
    widened["fields"][0]["type"] = "long"
    assert can_read(parse_avro(text(widened)), parse_avro(text(linked)))
    assert not can_read(parse_avro(text(linked)), parse_avro(text(widened)))


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=20,
    )
)
def test_any_json_parses_or_is_refused_with_a_typed_error(doc: Any) -> None:
    try:
        parse_avro(json.dumps(doc))
    except InvalidAvroSchema:
        pass


def test_hostile_definitions_are_refused_not_crashing() -> None:
    for levels in (100, 100_000):  # deeper than our bound; deeper than the JSON decoder's
        deep = '{"type": "array", "items": ' * levels + '"int"' + "}" * levels
        with pytest.raises(InvalidAvroSchema, match="nested deeper"):
            parse_avro(deep)
    with pytest.raises(InvalidAvroSchema, match="not JSON"):
        parse_avro(b"\xff\xfe")
    with pytest.raises(InvalidAvroSchema, match="unknown type"):
        parse_avro('{"type": "record", "name": "R", "fields": [{"name": "x", "type": "Nope"}]}')
    with pytest.raises(InvalidAvroSchema, match="defined twice"):
        parse_avro('["null", {"type": "fixed", "name": "F", "size": 1},'
                   ' {"type": "fixed", "name": "F", "size": 2}]')  # fmt: skip
