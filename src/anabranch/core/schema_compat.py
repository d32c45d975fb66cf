"""Schema compatibility: Avro schema resolution and Pulsar's compatibility strategies.

Pure logic (no I/O). A Pulsar ``AVRO`` or ``JSON`` schema carries an Avro schema definition
(JSON text); whether data written with one definition can be read with another is Avro's
*schema resolution* (Avro 1.11 specification, "Schema Resolution"):

* the same primitive; or a promotion ``int → long → float → double``, ``string ↔ bytes``;
* records (whatever their names, as upstream's validator has it: see ``_Resolver``): every
  reader field is in the writer (by name or alias) with a resolvable type, or has a
  default; writer-only fields are skipped;
* enums of the same name: every writer symbol is a reader symbol, or the reader has a
  default symbol; fixed of the same name and size; arrays/maps by their item/value types;
* a writer union: every branch must resolve; a reader union: some branch must.

Pulsar's strategies (``SchemaCompatibilityStrategy``) decide *against which* existing
versions and *in which direction* a new schema is checked: ``BACKWARD`` (the new schema
reads data of the latest one), ``FORWARD`` (the latest reads the new), ``FULL`` (both),
their ``_TRANSITIVE`` forms against every version, and ``ALWAYS_COMPATIBLE`` /
``ALWAYS_INCOMPATIBLE``.

Example:
    >>> v1 = '{"type":"record","name":"U","fields":[{"name":"a","type":"int"}]}'
    >>> v2 = ('{"type":"record","name":"U","fields":[{"name":"a","type":"long"},'
    ...       '{"name":"b","type":"string","default":""}]}')
    >>> can_read(parse_avro(v2), parse_avro(v1))      # v2 reads v1 data: int → long, b default
    True
    >>> can_read(parse_avro(v1), parse_avro(v2))      # v1 cannot read a long as an int
    False
    >>> renamed = v1.replace('"U"', '"Renamed"')          # records resolve by fields, not name
    >>> can_read(parse_avro(renamed), parse_avro(v1))
    True
    >>> check_compatible(Strategy.BACKWARD, [v1], v2)
    >>> try:
    ...     check_compatible(Strategy.FULL, [v1], v2)
    ... except Incompatible as err:
    ...     print(err)
    FULL: an existing version cannot read the new schema's data
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
_PROMOTIONS = {
    "int": {"long", "float", "double"},
    "long": {"float", "double"},
    "float": {"double"},
    "string": {"bytes"},
    "bytes": {"string"},
}
MAX_DEPTH = 64
"""Nesting bound of a definition: a hostile schema cannot recurse the parser to death."""


class InvalidAvroSchema(ValueError):
    """Schema data that is not a valid Avro schema definition."""


class Incompatible(ValueError):
    """A new schema the strategy refuses; the message says which direction failed."""


class Strategy(enum.StrEnum):
    """Pulsar's ``SchemaCompatibilityStrategy`` values (``UNDEFINED``: inherit)."""

    UNDEFINED = "UNDEFINED"
    ALWAYS_INCOMPATIBLE = "ALWAYS_INCOMPATIBLE"
    ALWAYS_COMPATIBLE = "ALWAYS_COMPATIBLE"
    BACKWARD = "BACKWARD"
    FORWARD = "FORWARD"
    FULL = "FULL"
    BACKWARD_TRANSITIVE = "BACKWARD_TRANSITIVE"
    FORWARD_TRANSITIVE = "FORWARD_TRANSITIVE"
    FULL_TRANSITIVE = "FULL_TRANSITIVE"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """A strategy from its name (case-insensitive); ValueError names the valid ones.

        Example:
            >>> Strategy.parse("backward_transitive")
            <Strategy.BACKWARD_TRANSITIVE: 'BACKWARD_TRANSITIVE'>
        """
        try:
            return cls(text.strip().upper())
        except ValueError:
            valid = ", ".join(s.value for s in cls)
            raise ValueError(
                f"unknown schema compatibility strategy {text!r}; one of {valid}"
            ) from None


@dataclass(frozen=True)
class AvroType:
    """One node of a parsed Avro schema. ``kind`` is a primitive name or one of
    ``record``, ``enum``, ``fixed``, ``array``, ``map``, ``union``, ``ref`` (a named type
    used again by name: ``name`` holds it, resolved through :attr:`Parsed.names`)."""

    kind: str
    name: str = ""
    fields: tuple[AvroField, ...] = ()
    symbols: tuple[str, ...] = ()
    enum_default: str | None = None
    size: int = 0
    items: tuple[AvroType, ...] = ()
    """The element type (array), the value type (map), or the branches (union)."""
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class AvroField:
    """A record field: its name, aliases, type and whether it has a default."""

    name: str
    type: AvroType
    has_default: bool
    aliases: tuple[str, ...] = ()


@dataclass
class Parsed:
    """A parsed definition: its root type and every named type it defines (full names)."""

    root: AvroType
    names: dict[str, AvroType] = field(default_factory=dict)


def parse_avro(text: str | bytes) -> Parsed:
    """Parse an Avro schema definition; InvalidAvroSchema says what is wrong.

    Example:
        >>> parse_avro('"string"').root.kind
        'string'
        >>> parse_avro('{"type": "array"}')
        Traceback (most recent call last):
        ...
        anabranch.core.schema_compat.InvalidAvroSchema: array without items
    """
    try:
        doc = json.loads(text)
    except RecursionError:
        raise InvalidAvroSchema(
            f"not JSON this parser accepts: nested deeper than {MAX_DEPTH}"
        ) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise InvalidAvroSchema(f"not JSON: {err}") from None
    parsed = Parsed(AvroType("null"))
    parsed.root = _parse(doc, "", parsed.names, 0)
    return parsed


def _full_name(name: str, namespace: str) -> str:
    if "." in name or not namespace:
        return name
    return f"{namespace}.{name}"


def _parse(doc: Any, namespace: str, names: dict[str, AvroType], depth: int) -> AvroType:
    if depth > MAX_DEPTH:
        raise InvalidAvroSchema(f"nested deeper than {MAX_DEPTH}")
    if isinstance(doc, str):
        if doc in PRIMITIVES:
            return AvroType(doc)
        full = _full_name(doc, namespace)
        for candidate in (full, doc):
            if candidate in names:
                return AvroType("ref", name=candidate)
        raise InvalidAvroSchema(f"unknown type {doc!r}")
    if isinstance(doc, list):
        branches = tuple(_parse(b, namespace, names, depth + 1) for b in doc)
        if any(b.kind == "union" for b in branches):
            raise InvalidAvroSchema("a union directly inside a union")
        return AvroType("union", items=branches)
    if not isinstance(doc, dict):
        raise InvalidAvroSchema(f"a type must be a string, list or object, not {doc!r}")
    kind = doc.get("type")
    if isinstance(kind, (dict, list)):
        return _parse(kind, namespace, names, depth + 1)  # {"type": {...}} wraps a type
    if not isinstance(kind, str):
        raise InvalidAvroSchema("an object without a 'type'")
    if kind in PRIMITIVES:
        return AvroType(kind)  # logical types resolve as their underlying type
    if kind == "array":
        if "items" not in doc:
            raise InvalidAvroSchema("array without items")
        return AvroType("array", items=(_parse(doc["items"], namespace, names, depth + 1),))
    if kind == "map":
        if "values" not in doc:
            raise InvalidAvroSchema("map without values")
        return AvroType("map", items=(_parse(doc["values"], namespace, names, depth + 1),))
    if kind in ("record", "error", "enum", "fixed"):
        return _parse_named(doc, "record" if kind == "error" else kind, namespace, names, depth)
    return _parse(kind, namespace, names, depth + 1)  # {"type": "SomeNamedType"}


def _parse_named(
    doc: dict[str, Any], kind: str, namespace: str, names: dict[str, AvroType], depth: int
) -> AvroType:
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidAvroSchema(f"{kind} without a name")
    own_ns = doc.get("namespace") if isinstance(doc.get("namespace"), str) else namespace
    full = _full_name(name, own_ns or "")
    if full in names:
        raise InvalidAvroSchema(f"type {full!r} defined twice")
    inner_ns = full.rsplit(".", 1)[0] if "." in full else ""
    aliases = tuple(a for a in doc.get("aliases", ()) if isinstance(a, str))
    if kind == "enum":
        symbols = doc.get("symbols")
        if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
            raise InvalidAvroSchema(f"enum {full!r} without a list of symbols")
        default = doc.get("default")
        node = AvroType(
            "enum", name=full, symbols=tuple(symbols),
            enum_default=default if isinstance(default, str) else None, aliases=aliases,
        )  # fmt: skip
        names[full] = node
        return node
    if kind == "fixed":
        size = doc.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidAvroSchema(f"fixed {full!r} without a size")
        node = AvroType("fixed", name=full, size=size, aliases=aliases)
        names[full] = node
        return node
    raw_fields = doc.get("fields")
    if not isinstance(raw_fields, list):
        raise InvalidAvroSchema(f"record {full!r} without a list of fields")
    # Register before the fields so a recursive record (a linked list) refers to itself.
    names[full] = AvroType("record", name=full, aliases=aliases)
    parsed_fields = []
    for raw in raw_fields:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or "type" not in raw:
            raise InvalidAvroSchema(f"record {full!r} has a field without a name or type")
        field_aliases = tuple(a for a in raw.get("aliases", ()) if isinstance(a, str))
        parsed_fields.append(
            AvroField(
                raw["name"], _parse(raw["type"], inner_ns, names, depth + 1),
                "default" in raw, field_aliases,
            )
        )  # fmt: skip
    node = AvroType("record", name=full, fields=tuple(parsed_fields), aliases=aliases)
    names[full] = node
    return node


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _same_name(reader: AvroType, writer: AvroType) -> bool:
    # Avro matches unqualified names (and reader aliases); Pulsar's Java validator does too.
    wanted = {_short(writer.name)}
    return _short(reader.name) in wanted or any(_short(a) in wanted for a in reader.aliases)


def can_read(reader: Parsed, writer: Parsed) -> bool:
    """Whether data written with ``writer`` can be read with ``reader`` (Avro resolution).

    Example:
        >>> can_read(parse_avro('["null", "long"]'), parse_avro('"int"'))
        True
    """
    return _Resolver(reader.names, writer.names).resolves(reader.root, writer.root)


class _Resolver:
    def __init__(self, reader_names: dict[str, AvroType], writer_names: dict[str, AvroType]):
        self.reader_names = reader_names
        self.writer_names = writer_names
        self.assumed: set[tuple[str, str]] = set()
        """Record pairs under comparison: a recursive reference to one is taken as resolving
        (co-inductive: a mismatch elsewhere still fails)."""

    def resolves(self, reader: AvroType, writer: AvroType) -> bool:
        if reader.kind == "ref":
            reader = self.reader_names[reader.name]
        if writer.kind == "ref":
            writer = self.writer_names[writer.name]
        if writer.kind == "union":
            return all(self.resolves(reader, branch) for branch in writer.items)
        if reader.kind == "union":
            return any(self.resolves(branch, writer) for branch in reader.items)
        if reader.kind != writer.kind:
            return reader.kind in _PROMOTIONS.get(writer.kind, ())
        if reader.kind in PRIMITIVES:
            return True
        if reader.kind in ("array", "map"):
            return self.resolves(reader.items[0], writer.items[0])
        if reader.kind == "record":
            # Pulsar checks with Avro's ResolvingGrammarGenerator, which matches records by
            # their fields only (enums and fixed must share a name): a producer may rename its
            # record class (User1 -> User2) and still evolve the topic's schema.
            return self._record(reader, writer)
        if not _same_name(reader, writer):
            return False
        if reader.kind == "fixed":
            return reader.size == writer.size
        if reader.kind == "enum":
            missing = set(writer.symbols) - set(reader.symbols)
            return not missing or reader.enum_default in reader.symbols
        return self._record(reader, writer)

    def _record(self, reader: AvroType, writer: AvroType) -> bool:
        pair = (reader.name, writer.name)
        if pair in self.assumed:
            return True
        self.assumed.add(pair)
        written = {f.name: f for f in writer.fields}
        for wanted in reader.fields:
            source = written.get(wanted.name)
            if source is None:
                source = next((written[a] for a in wanted.aliases if a in written), None)
            if source is None:
                if not wanted.has_default:
                    return False
            elif not self.resolves(wanted.type, source.type):
                return False
        return True


def _check_pair(strategy: Strategy, existing: Parsed, new: Parsed) -> None:
    backward = strategy in (Strategy.BACKWARD, Strategy.BACKWARD_TRANSITIVE, Strategy.FULL,
                            Strategy.FULL_TRANSITIVE)  # fmt: skip
    forward = strategy in (Strategy.FORWARD, Strategy.FORWARD_TRANSITIVE, Strategy.FULL,
                           Strategy.FULL_TRANSITIVE)  # fmt: skip
    if backward and not can_read(new, existing):
        raise Incompatible(f"{strategy}: the new schema cannot read an existing version's data")
    if forward and not can_read(existing, new):
        raise Incompatible(f"{strategy}: an existing version cannot read the new schema's data")


def check_compatible(strategy: Strategy, existing: Sequence[str | bytes], new: str | bytes) -> None:
    """Raise Incompatible unless ``new`` may follow ``existing`` (oldest first) under
    ``strategy``; InvalidAvroSchema if ``new`` is not a valid definition.

    Non-transitive strategies compare with the latest version only. ``UNDEFINED`` must be
    resolved by the caller (namespace → broker default) first.

    Example:
        >>> v1 = '{"type":"record","name":"U","fields":[{"name":"a","type":"int"}]}'
        >>> v2 = '{"type":"record","name":"U","fields":[{"name":"b","type":"int"}]}'
        >>> check_compatible(Strategy.ALWAYS_COMPATIBLE, [v1], v2)
        >>> try:
        ...     check_compatible(Strategy.BACKWARD, [v1], v2)
        ... except Incompatible as err:
        ...     print(err)
        BACKWARD: the new schema cannot read an existing version's data
    """
    if strategy is Strategy.UNDEFINED:
        raise ValueError("resolve UNDEFINED to the namespace's or broker's strategy first")
    parsed_new = parse_avro(new)
    if strategy is Strategy.ALWAYS_COMPATIBLE or not existing:
        return
    if strategy is Strategy.ALWAYS_INCOMPATIBLE:
        raise Incompatible("ALWAYS_INCOMPATIBLE: the topic's schema cannot change")
    transitive = strategy.value.endswith("_TRANSITIVE")
    against = existing if transitive else existing[-1:]
    for old in against:
        try:
            parsed_old = parse_avro(old)
        except InvalidAvroSchema:
            continue  # a version stored before validation existed cannot be compared
        _check_pair(strategy, parsed_old, parsed_new)
