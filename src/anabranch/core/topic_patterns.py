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
degree); those, too, are left to the client.

Example:
    >>> p = compile_safely("persistent://public/default/orders-.*")
    >>> filter_topics(["persistent://public/default/orders-1-partition-0",
    ...                "persistent://public/default/audit"], p)
    ['persistent://public/default/orders-1-partition-0']
    >>> compile_safely("public/default/(a+)+$") is None
    True
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable

from anabranch import limits

__all__ = [
    "compile_safely",
    "filter_topics",
    "has_nested_quantifier",
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


def _strip_domain(pattern: str) -> str:
    return pattern.split("://", 1)[1] if "://" in pattern else pattern


def compile_safely(pattern: str) -> re.Pattern[str] | None:
    """The compiled pattern (domain stripped), or None when the broker must not evaluate
    it: longer than ``limits.TOPICS_PATTERN_LENGTH_MAX``, nested quantifiers, more than
    ``limits.TOPICS_PATTERN_UNBOUNDED_QUANTIFIERS_MAX`` unbounded ones, or invalid.

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
