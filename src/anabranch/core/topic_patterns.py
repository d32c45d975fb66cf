"""Topic-name patterns of regex subscriptions: safe broker-side evaluation, filtering and
the topic-list hash, as upstream's ``TopicList`` defines them.

Upstream facts followed here:

* a pattern is matched against the topic's *partitioned* name without its domain
  (``t/ns/orders-1`` for ``persistent://t/ns/orders-1-partition-0``), as a full match;
  a pattern that carries a domain (``persistent://t/ns/orders-.*``) is matched without it;
* the list hash is CRC32C over the sorted names (``TopicList.calculateHash``; see
  :func:`anabranch.broker.scalable_commands.topics_hash`);
* a pattern longer than ``subscriptionPatternMaxLength`` (50) is not evaluated by the
  broker: GET_TOPICS_OF_NAMESPACE answers unfiltered (``filtered=false``) and the client
  filters; a watcher with such a pattern is refused.

A client-supplied regular expression is hostile input: backtracking on a pattern with
nested quantifiers (``(a+)+$``) is exponential. :func:`compile_safely` therefore also
refuses patterns whose quantified groups contain a quantifier or an alternation, and
patterns with more than a few unbounded quantifiers (``.*.*.*.*x`` is polynomial of a high
degree); those, too, are left to the client. Bounded repeats backtrack as much as unbounded
ones over a name shorter than their bound (``.{0,300}`` six times is ``len(name) ** 6``),
so every pattern must also pass :func:`match_cost`: an upper bound, from the parsed
pattern, on the steps of one match against the longest topic name.

Example:
    >>> p = compile_safely("persistent://public/default/orders-.*")
    >>> filter_topics(["persistent://public/default/orders-1-partition-0",
    ...                "persistent://public/default/audit"], p)
    ['persistent://public/default/orders-1-partition-0']
    >>> compile_safely("public/default/(a+)+$") is None
    True
    >>> compile_safely(".{0,300}" * 6 + "b") is None
    True
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from anabranch import limits
from anabranch.core.names import NAME_COMPONENT_CHARS_MAX

if TYPE_CHECKING:
    # The stubs of the stdlib's regex parser; at run time the same module under its
    # private name (importing ``sre_parse`` warns of its deprecation since 3.11).
    import sre_constants as _sre
    import sre_parse as _sre_parse
else:
    from re import _constants as _sre
    from re import _parser as _sre_parse

__all__ = [
    "compile_safely",
    "filter_topics",
    "has_nested_quantifier",
    "match_cost",
    "matches",
    "unbounded_quantifiers",
]

_QUANTIFIERS = frozenset("*+?{")
_PARTITION_SUFFIX = re.compile(r"-partition-\d+$")
"""What upstream's ``TopicName.getPartitionedTopicName`` strips (only a trailing one)."""


def has_nested_quantifier(pattern: str) -> bool:
    """Whether a quantified group of ``pattern`` contains a quantifier or an alternation
    (the shapes whose backtracking can be exponential: ``(a+)+``, ``(a|aa)*``).

    A conservative scan (escapes and character classes skipped, groups tracked); it may
    call a harmless pattern risky, never the reverse for these shapes.

    Example:
        >>> has_nested_quantifier("orders-.*"), has_nested_quantifier("(a+)+$")
        (False, True)
        >>> has_nested_quantifier("(x|y)*"), has_nested_quantifier("(ab)+")
        (True, False)
    """
    # One frame per open group: does its body hold a quantifier or a '|'?
    stack: list[bool] = [False]
    closed_risky = False  # the group just closed held one (a quantifier next is nested)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            closed_risky = False
            continue
        if c == "[":
            i = _skip_class(pattern, i)
            closed_risky = False
            continue
        if c == "(":
            stack.append(False)
            closed_risky = False
            if pattern.startswith("?", i + 1):
                i += 3  # (?: (?= (?! (?P...: the '?' opens an extension, not a quantifier
                continue
        elif c == ")":
            inner = stack.pop() if len(stack) > 1 else False
            closed_risky = inner
            if inner:
                stack[-1] = True  # the outer group holds what the inner one does
        elif c == "|":
            stack[-1] = True
            closed_risky = False
        elif c in _QUANTIFIERS:
            if closed_risky:
                return True
            stack[-1] = True
            closed_risky = False
        else:
            closed_risky = False
        i += 1
    return False


def unbounded_quantifiers(pattern: str) -> int:
    """How many ``*``, ``+`` and ``{n,}`` quantifiers ``pattern`` has (escapes and
    character classes skipped). ``k`` of them can make a failing match try on the order
    of ``len(name) ** k`` splits, so the broker evaluates only a few.

    Example:
        >>> unbounded_quantifiers(r".*a.+b\\*[*+]c{2,}d{3}")
        3
    """
    count, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            i = _skip_class(pattern, i)
            continue
        if c in "*+":
            count += 1
        elif c == "{":
            end = pattern.find("}", i)
            if end > i and pattern[i + 1 : end].endswith(","):
                count += 1
        i += 1
    return count


def _skip_class(pattern: str, start: int) -> int:
    """The index after the character class opening at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1  # a leading ']' is a literal
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


NAME_CHARS_MAX = 3 * NAME_COMPONENT_CHARS_MAX + 2
"""Longest string a pattern is matched against: ``tenant/namespace/local``, the domain and
the partition suffix stripped (:func:`matches`). Every bound of :func:`match_cost` is
taken over names this long."""

_COST_CAP = 2**62
"""What :func:`match_cost` answers for a pattern it cannot bound (sums and products
saturate there, so a huge bound stays a cheap integer)."""

# Character sets as bit masks: bit ``c`` for an ASCII character ``c`` (topic names are
# ASCII), one bit standing for every other character (so any two sets holding one may
# overlap), and one for the end of the name.
_OTHER = 1 << 128
_END = 1 << 129
_ANY_CHAR = (1 << 129) - 1
_UPPER_SHIFT, _LOWER_SHIFT, _ALPHABET = ord("A"), ord("a"), (1 << 26) - 1
_LETTERS = (_ALPHABET << _UPPER_SHIFT) | (_ALPHABET << _LOWER_SHIFT)


def _ascii_mask(escape: str) -> int:
    # Exact on ASCII whatever the flags; non-ASCII members are _OTHER, always included.
    return sum(1 << c for c in range(128) if re.fullmatch(escape, chr(c))) | _OTHER


_CATEGORY_MASKS: dict[int, int] = {
    _sre.CATEGORY_DIGIT: _ascii_mask(r"\d"),
    _sre.CATEGORY_NOT_DIGIT: _ascii_mask(r"\D"),
    _sre.CATEGORY_SPACE: _ascii_mask(r"\s"),
    _sre.CATEGORY_NOT_SPACE: _ascii_mask(r"\S"),
    _sre.CATEGORY_WORD: _ascii_mask(r"\w"),
    _sre.CATEGORY_NOT_WORD: _ascii_mask(r"\W"),
}
_ONE_CHAR = frozenset({_sre.LITERAL, _sre.NOT_LITERAL, _sre.ANY, _sre.IN, _sre.CATEGORY})
_REPEATS = frozenset({_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT})

_Item = tuple[int, object, bool]
"""A parsed node (opcode, argument) and whether it ignores case."""


class _Unbounded(Exception):
    """A construct :func:`match_cost` does not bound (backreferences, conditionals)."""


@dataclass(frozen=True)
class _Cost:
    """One attempt of a sub-pattern at one position: ``work``, its steps (those of what
    follows it excluded), and ``ends``, the times it goes on to what follows (each end
    and each way of reaching it: what backtracking multiplies)."""

    work: int
    ends: int


@dataclass(frozen=True)
class _Head:
    """What comes next fails within ``steps`` unless the next character (or the end, the
    _END bit) is in ``mask``. None where no such bound is known."""

    mask: int
    steps: int


def _add(a: int, b: int) -> int:
    return min(a + b, _COST_CAP)


def _mul(a: int, b: int) -> int:
    return min(a * b, _COST_CAP)


def _bit(char: int) -> int:
    return 1 << char if char < 128 else _OTHER


def _fold(mask: int) -> int:
    """``mask`` under IGNORECASE: both cases of its letters, and non-ASCII characters
    (the Kelvin sign matches ``k``) both ways."""
    upper = (mask >> _UPPER_SHIFT) & _ALPHABET
    lower = (mask >> _LOWER_SHIFT) & _ALPHABET
    mask |= (upper << _LOWER_SHIFT) | (lower << _UPPER_SHIFT)
    if mask & _LETTERS:
        mask |= _OTHER
    if mask & _OTHER:
        mask |= _LETTERS
    return mask


def _char_mask(op: int, arg: object, fold: bool) -> int:
    """The characters a one-character node matches (a superset)."""
    mask = _ANY_CHAR
    if op == _sre.LITERAL:
        mask = _bit(cast(int, arg))
    elif op == _sre.NOT_LITERAL:
        mask = (_ANY_CHAR & ~_bit(cast(int, arg))) | _OTHER
    elif op == _sre.CATEGORY:
        mask = _CATEGORY_MASKS.get(cast(int, arg), _ANY_CHAR)
    elif op == _sre.IN:
        mask, negate = 0, False
        for member, value in cast("list[tuple[int, object]]", arg):
            if member == _sre.NEGATE:
                negate = True
            elif member == _sre.LITERAL:
                mask |= _bit(cast(int, value))
            elif member == _sre.RANGE:
                low, high = cast("tuple[int, int]", value)
                top = min(high, 127)
                if low <= top:
                    mask |= ((1 << (top + 1)) - 1) & ~((1 << low) - 1)
                if high >= 128:
                    mask |= _OTHER
            else:
                mask |= _CATEGORY_MASKS.get(cast(int, value), _ANY_CHAR)
        if negate:
            mask = (_ANY_CHAR & ~mask) | _OTHER
    return _fold(mask) if fold else mask


def _flatten(sub: _sre_parse.SubPattern, fold: bool) -> list[_Item]:
    """The nodes of ``sub``, groups opened in place (a group only scopes flags)."""
    items: list[_Item] = []
    for op, arg in sub.data:
        if op == _sre.SUBPATTERN:
            _, add_flags, del_flags, inner = cast("tuple[object, int, int, object]", arg)
            inner_fold = bool(add_flags & _sre.SRE_FLAG_IGNORECASE) or (
                fold and not del_flags & _sre.SRE_FLAG_IGNORECASE
            )
            items.extend(_flatten(cast(_sre_parse.SubPattern, inner), inner_fold))
        else:
            items.append((op, arg, fold))
    return items


def _single_char(body: list[_Item]) -> int | None:
    """The character mask of a repeat's body that is one one-character node, else None."""
    if len(body) == 1 and body[0][0] in _ONE_CHAR:
        return _char_mask(*body[0])
    return None


def _head(item: _Item, after: _Head | None) -> _Head | None:
    """How fast ``item`` followed by what ``after`` describes fails (None: unknown)."""
    op, arg, fold = item
    if op in _ONE_CHAR:
        return _Head(_char_mask(op, arg, fold), 1)
    if op == _sre.AT:  # zero-width, checked in one step
        return None if after is None else _Head(after.mask, after.steps + 1)
    if op in _REPEATS:
        low, _, body = cast("tuple[int, int, _sre_parse.SubPattern]", arg)
        first = _sequence_head(_flatten(body, fold), None)
        if first is None:
            return None
        if low >= 1:
            return _Head(first.mask, first.steps + 1)
        if after is None:
            return None
        return _Head(first.mask | after.mask, first.steps + after.steps + 1)
    if op == _sre.BRANCH:
        heads = [_sequence_head(_flatten(alt, fold), after) for alt in _alternatives(arg)]
        if any(h is None for h in heads):
            return None
        known = [h for h in heads if h is not None]
        mask = 0
        for h in known:
            mask |= h.mask
        return _Head(mask, sum(h.steps for h in known) + 1)
    return None


def _sequence_head(items: list[_Item], after: _Head | None) -> _Head | None:
    head = after
    for item in reversed(items):
        head = _head(item, head)
    return head


def _alternatives(arg: object) -> list[_sre_parse.SubPattern]:
    return cast("tuple[None, list[_sre_parse.SubPattern]]", arg)[1]


def _sequence(items: list[_Item], after: _Head | None) -> _Cost:
    """The cost of ``items`` matched in a row: each item's ends try all that follows."""
    work, ends, head = 0, 1, after
    for item in reversed(items):
        cost = _item(item, head)
        work = _add(cost.work, _mul(cost.ends, work))
        ends = _mul(cost.ends, ends)
        head = _head(item, head)
    return _Cost(work, ends)


def _item(item: _Item, after: _Head | None) -> _Cost:
    op, arg, fold = item
    if op in _ONE_CHAR or op == _sre.AT:
        # Not a step: the characters tested between two positions tried are at most the
        # pattern's length (sre compares a literal run in a tight loop).
        return _Cost(0, 1)
    if op in _REPEATS:
        return _repeat(item, after)
    if op == _sre.BRANCH:
        return _branch([_flatten(alt, fold) for alt in _alternatives(arg)], after)
    if op in (_sre.ASSERT, _sre.ASSERT_NOT, _sre.ATOMIC_GROUP):
        # Matched once, never backtracked into: its first success ends it.
        inner = arg if op == _sre.ATOMIC_GROUP else cast("tuple[int, object]", arg)[1]
        cost = _sequence(_flatten(cast(_sre_parse.SubPattern, inner), fold), None)
        return _Cost(_add(cost.work, 1), 1)
    # Backreferences (matching with them is NP-hard) and anything unknown.
    raise _Unbounded(op)


def _branch(alternatives: list[list[_Item]], after: _Head | None) -> _Cost:
    costs = [_sequence(alt, after) for alt in alternatives]
    heads = [_sequence_head(alt, after) for alt in alternatives]
    known = [h for h in heads if h is not None]
    seen, disjoint = 0, len(known) == len(heads)
    for h in known:
        disjoint = disjoint and not seen & h.mask
        seen |= h.mask
    if disjoint:
        # A character starts at most one alternative; the others fail at once.
        steps = sum(h.steps for h in known)
        return _Cost(_add(steps, max(c.work for c in costs)), max(c.ends for c in costs))
    work, ends = len(costs), 0
    for c in costs:
        work, ends = _add(work, c.work), _add(ends, c.ends)
    return _Cost(work, ends)


def _repeat(item: _Item, after: _Head | None) -> _Cost:
    op, arg, fold = item
    low, high, body = cast("tuple[int, int, _sre_parse.SubPattern]", arg)
    possessive = op == _sre.POSSESSIVE_REPEAT
    items = _flatten(body, fold)
    char = _single_char(items)
    if char is not None:
        # One character a time: a scan, then one end per count in [low, top].
        top = min(high, NAME_CHARS_MAX)
        scan = top + 1
        if after is not None and not char & after.mask:
            # Before the run's last character what follows sees one of ``char`` and
            # fails at once: only the run's end goes on (``[0-9]+-``, ``.*`` last).
            return _Cost(_mul(scan, after.steps + 1), 1)
        return _Cost(scan, 1 if possessive else max(1, top - low + 1))
    inner = _sequence(items, None)
    width = body.getwidth()[0]
    # Past ``low``, an iteration must consume a character (sre stops on an empty one).
    top = min(high, NAME_CHARS_MAX // width if width else _add(low, NAME_CHARS_MAX))
    if inner.ends <= 1:
        nodes = top + 1
        ends = max(1, top - low + 1)
    else:  # every way of matching each iteration: exponential in ``top``
        nodes = _COST_CAP if top >= 64 else min((top + 1) * inner.ends**top, _COST_CAP)
        ends = nodes
    return _Cost(_mul(nodes, _add(inner.work, 1)), 1 if possessive else ends)


def match_cost(pattern: str) -> int:
    """An upper bound on the steps of one ``re`` full match of ``pattern`` against any
    topic name of up to :data:`NAME_CHARS_MAX` characters, or ``2**62`` for a pattern it
    cannot bound (backreferences, conditionals) or parse. A step is a position the
    backtracking tries or a character a repeat scans; the literal characters tested in
    between are at most the pattern's length and not counted.

    The pattern is parsed as ``re`` parses it. In a row of items, each way an item can end
    tries everything after it, so the bound is about the product of what the items can
    repeat over (``min(max, name length) - min + 1`` counts of a repeat, bounded or not;
    the ways of a branch), except where only one way can go on: the character after a
    repeated one cannot be one of them (``[0-9]+-``, ``.*`` last), or an alternation's
    branches start with different characters (``(eu|us)``).

    Example:
        >>> match_cost("orders-.*")  # only the end of the name may follow: one scan
        1537
        >>> limit = limits.TOPICS_PATTERN_MATCH_STEPS_MAX
        >>> match_cost(".*-(eu|us)-.*") < limit < match_cost(".{0,300}" * 6 + "b")
        True
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # as compile_safely: a client's odd pattern
            parsed = _sre_parse.parse(pattern)
        fold = bool(parsed.state.flags & _sre.SRE_FLAG_IGNORECASE)
        # Full match: the end of the name is all that may follow the last item.
        cost = _sequence(_flatten(parsed, fold), _Head(_END, 1))
    except (re.error, RecursionError, OverflowError, _Unbounded):
        return _COST_CAP
    return _add(cost.work, cost.ends)


def _strip_domain(pattern: str) -> str:
    return pattern.split("://", 1)[1] if "://" in pattern else pattern


def compile_safely(pattern: str) -> re.Pattern[str] | None:
    """The compiled pattern (domain stripped), or None when the broker must not evaluate
    it: longer than ``limits.TOPICS_PATTERN_LENGTH_MAX``, nested quantifiers, more than
    ``limits.TOPICS_PATTERN_UNBOUNDED_QUANTIFIERS_MAX`` unbounded ones, a
    :func:`match_cost` over ``limits.TOPICS_PATTERN_MATCH_STEPS_MAX``, or invalid.

    Example:
        >>> compile_safely("public/default/x.*").pattern
        'public/default/x.*'
        >>> compile_safely("x" * 500) is None, compile_safely("(") is None
        (True, True)
    """
    if len(pattern) > limits.TOPICS_PATTERN_LENGTH_MAX:
        return None
    body = _strip_domain(pattern)
    if (
        has_nested_quantifier(body)
        or unbounded_quantifiers(body) > limits.TOPICS_PATTERN_UNBOUNDED_QUANTIFIERS_MAX
        or match_cost(body) > limits.TOPICS_PATTERN_MATCH_STEPS_MAX
    ):
        return None
    try:
        with warnings.catch_warnings():
            # A client's odd pattern ('[[' warns of nested sets) is not the broker's to log.
            warnings.simplefilter("ignore")
            return re.compile(body)
    except (re.error, RecursionError, OverflowError):
        return None


def matches(topic: str, pattern: re.Pattern[str]) -> bool:
    """Whether ``topic`` (a full name, maybe a partition) matches, upstream's way.

    Example:
        >>> matches("persistent://t/n/a-partition-3", re.compile("t/n/a"))
        True
        >>> matches("persistent://t/n/a-partition-x", re.compile("t/n/a"))
        False
    """
    base = _PARTITION_SUFFIX.sub("", topic)
    return pattern.fullmatch(_strip_domain(base)) is not None


def filter_topics(topics: Iterable[str], pattern: re.Pattern[str]) -> list[str]:
    """The names of ``topics`` that match ``pattern``, in their order.

    Example:
        >>> filter_topics(["persistent://t/n/a", "persistent://t/n/b"], re.compile("t/n/b"))
        ['persistent://t/n/b']
    """
    return [topic for topic in topics if matches(topic, pattern)]
