"""The recorded history of a fault run: one JSON object per line, in the order they happened.

Every client operation is logged as an ``invoke`` and then one completion: ``ok``
(happened), ``fail`` (definitely did not happen) or ``info`` (indeterminate: a timeout,
a dropped connection). A delivery to a consumer is one ``ok`` op of ``f="recv"`` (the
receive call that returned nothing is not logged). Nemesis faults are ``info`` ops of
process ``"nemesis"`` with ``f="start"`` / ``f="stop"``; the final heal-all is
``f="heal"``. Times ``t`` are seconds on the monotonic clock since the run started.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> h = History(out, clock=iter([0.5, 0.75]).__next__)
    >>> _ = h.record("producer-0", "invoke", "send", {"key": "k", "value": "v"})
    >>> _ = h.record("producer-0", "ok", "send", {"key": "k", "value": "v"})
    >>> ops = load_history(io.StringIO(out.getvalue()))
    >>> [(op.index, op.t, op.type) for op in ops]
    [(0, 0.5, 'invoke'), (1, 0.75, 'ok')]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

OpType = Literal["invoke", "ok", "fail", "info"]
NEMESIS = "nemesis"


@dataclass(frozen=True)
class Op:
    """One history line."""

    index: int
    t: float
    process: str
    type: str
    f: str
    value: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index,
                "t": round(self.t, 6),
                "process": self.process,
                "type": self.type,
                "f": self.f,
                "value": self.value,
            },
            sort_keys=True,
        )

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Op:
        return cls(
            int(obj["index"]),
            float(obj["t"]),
            str(obj["process"]),
            str(obj["type"]),
            str(obj["f"]),
            dict(obj.get("value") or {}),
        )


class History:
    """Appends ops to ``out`` (flushed per line, so a crashed run leaves a usable file)
    and keeps them in memory for the checker. ``clock`` defaults to the monotonic clock
    relative to construction."""

    def __init__(self, out: IO[str] | None = None, clock: Callable[[], float] | None = None):
        self._out = out
        self._start = time.monotonic()
        self._clock: Callable[[], float] = clock or self._since_start
        self.ops: list[Op] = []

    def _since_start(self) -> float:
        return time.monotonic() - self._start

    @classmethod
    def to_file(cls, path: Path) -> History:
        """A history appending to ``path`` (created or truncated)."""
        return cls(path.open("w", encoding="utf-8"))

    def now(self) -> float:
        """The history's clock: seconds since the run started."""
        return self._clock()

    def record(
        self, process: str, type_: OpType, f: str, value: dict[str, Any] | None = None
    ) -> Op:
        op = Op(len(self.ops), self._clock(), process, type_, f, dict(value or {}))
        self.ops.append(op)
        if self._out is not None:
            self._out.write(op.to_json() + "\n")
            self._out.flush()
        return op

    def nemesis(self, f: str, value: dict[str, Any]) -> Op:
        """A nemesis event (``start``, ``stop``, ``heal``)."""
        return self.record(NEMESIS, "info", f, value)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


def load_history(source: IO[str] | Path | Iterable[str]) -> list[Op]:
    """Parse a JSONL history (a path, an open file or lines)."""
    if isinstance(source, Path):
        with source.open(encoding="utf-8") as f:
            return list(_parse(f))
    return list(_parse(source))


def _parse(lines: Iterable[str]) -> Iterator[Op]:
    for line in lines:
        if line.strip():
            yield Op.from_dict(json.loads(line))
