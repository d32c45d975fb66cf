"""Which segments a key lived in: the final layout DAG and ``segment_hash``.

A key's messages are ordered across splits and merges by the DAG: every segment whose
hash range holds ``segment_hash(key)`` is on the key's lineage, and a segment's
ancestors on that lineage hold the key's earlier messages. The checker asks two
questions: may this key be in that segment at all, and is segment ``a`` an ancestor of
segment ``b``.

Example:
    >>> from anabranch.core.segment_layout import SegmentLayout
    >>> layout = SegmentLayout.initial(1, 0).split(0, 1)   # 0 -> 1 [0000-7fff], 2 [8000-ffff]
    >>> lineage = Lineage(layout)
    >>> lineage.segments_of("key-0")   # segment_hash("key-0") == 0xe337
    (0, 2)
    >>> lineage.holds(1, "key-0"), lineage.is_ancestor(0, 2), lineage.is_ancestor(2, 0)
    (False, True, False)
"""

from __future__ import annotations

from functools import cache

from anabranch.core.hash_range import segment_hash
from anabranch.core.segment_layout import SegmentLayout


class Lineage:
    """Ancestry and key membership over one (final) layout."""

    def __init__(self, layout: SegmentLayout) -> None:
        self.layout = layout
        self._ancestors = cache(layout.ancestors)
        self._hash = cache(segment_hash)

    def known(self, segment_id: int) -> bool:
        return segment_id in self.layout.segments

    def holds(self, segment_id: int, key: str) -> bool:
        """Whether ``key`` hashes into the segment's range (unknown segments: False)."""
        segment = self.layout.segments.get(segment_id)
        return segment is not None and segment.hash_range.contains(self._hash(key))

    def segments_of(self, key: str) -> tuple[int, ...]:
        """Every segment (by id, oldest first) whose range holds ``key``: its lineage."""
        h = self._hash(key)
        return tuple(sorted(s.segment_id for s in self.layout if s.hash_range.contains(h)))

    def is_ancestor(self, ancestor: int, segment_id: int) -> bool:
        """Whether ``ancestor`` is reachable from ``segment_id`` through parent links."""
        if not (self.known(ancestor) and self.known(segment_id)):
            return False
        return ancestor in self._ancestors(segment_id)
