"""A topic's backlog-quota gate: refuse or hold producers while its backlog is over quota.

The broker's backlog sweep (:mod:`anabranch.broker.retention`) decides, with
:mod:`anabranch.core.retention`, whether a topic is over a quota whose policy acts on
producers, and sets :attr:`QuotaGate.blocked`:

* ``producer_exception``: new producers and every send fail with
  ProducerBlockedQuotaExceeded (wire ``ProducerBlockedQuotaExceededException``);
* ``producer_request_hold``: sends wait, in arrival order, until the sweep finds the backlog
  back under quota; one held longer than ``hold_max_s`` (on the broker's clock) fails with
  ProducerQuotaHoldTimeout (wire ``ProducerBlockedQuotaExceededError``);
* None: everything passes; held sends are released in order at once.

Example:
    >>> from anabranch.clock import SystemClock
    >>> async def demo(gate: QuotaGate, send: Callable[[], asyncio.Future[Position]]) -> None:
    ...     print(gate.admit(send))           # not blocked: None, the caller sends now
    ...     gate.set_blocked(BacklogPolicy.PRODUCER_REQUEST_HOLD)
    ...     held = gate.admit(send)           # a future: the send waits
    ...     print(gate.held)
    ...     gate.set_blocked(None)            # the backlog shrank: it is sent now
    ...     print(await held)
    ...     await gate.close()
    >>> async def send() -> Position:         # stands for the topic's append
    ...     return Position(3, 0)
    >>> async def main() -> None:
    ...     gate = QuotaGate("persistent://public/default/t", SystemClock(), hold_max_s=30)
    ...     await demo(gate, lambda: asyncio.ensure_future(send()))
    >>> asyncio.run(main())
    None
    1
    Position(ledger_id=3, entry_id=0)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from anabranch.clock import Clock
from anabranch.core.retention import BacklogPolicy
from anabranch.errors import Closed, ProducerBlockedQuotaExceeded, ProducerQuotaHoldTimeout
from anabranch.storage.api import Position

Send = Callable[[], "asyncio.Future[Position]"]


class QuotaGate:
    """See the module docstring."""

    def __init__(self, topic: str, clock: Clock, hold_max_s: float) -> None:
        self.topic = topic
        self.clock = clock
        self.hold_max_s = hold_max_s
        self.blocked: BacklogPolicy | None = None
        self._held: deque[tuple[float, asyncio.Future[Position], Send]] = deque()
        self._timer: asyncio.Task[None] | None = None

    def check_producer(self) -> None:
        """Raise ProducerBlockedQuotaExceeded when producers are refused."""
        if self.blocked is BacklogPolicy.PRODUCER_EXCEPTION:
            raise ProducerBlockedQuotaExceeded(f"{self.topic}: the backlog is over its quota")

    def admit(self, send: Send) -> asyncio.Future[Position] | None:
        """None when ``send`` may run now; a future of its result when it is held. Raises
        ProducerBlockedQuotaExceeded when sends are refused."""
        self.check_producer()
        if self.blocked is not BacklogPolicy.PRODUCER_REQUEST_HOLD and not self._held:
            return None
        fut: asyncio.Future[Position] = asyncio.get_running_loop().create_future()
        self._held.append((self.clock.monotonic() + self.hold_max_s, fut, send))
        if self._timer is None or self._timer.done():
            self._timer = asyncio.ensure_future(self._expire_held())
        return fut

    @property
    def held(self) -> int:
        """Sends waiting now."""
        return len(self._held)

    def set_blocked(self, policy: BacklogPolicy | None) -> None:
        """The sweep's verdict; releases (or refuses) held sends as it implies."""
        self.blocked = policy
        if policy is BacklogPolicy.PRODUCER_REQUEST_HOLD:
            return
        held, self._held = self._held, deque()
        for _, fut, send in held:
            if fut.done():
                continue
            if policy is BacklogPolicy.PRODUCER_EXCEPTION:
                fut.set_exception(
                    ProducerBlockedQuotaExceeded(f"{self.topic}: the backlog is over its quota")
                )
                continue
            try:
                _chain(send(), fut)
            except Exception as err:
                fut.set_exception(err)

    async def _expire_held(self) -> None:
        while self._held:
            deadline = self._held[0][0]
            await self.clock.sleep(max(deadline - self.clock.monotonic(), 0))
            now = self.clock.monotonic()
            while self._held and self._held[0][0] <= now:
                _, fut, _ = self._held.popleft()
                if not fut.done():
                    fut.set_exception(
                        ProducerQuotaHoldTimeout(
                            f"{self.topic}: held {self.hold_max_s}s and the backlog is still"
                            " over its quota"
                        )
                    )

    async def close(self) -> None:
        """Fail every held send with Closed and stop the timer."""
        held, self._held = self._held, deque()
        for _, fut, _ in held:
            if not fut.done():
                fut.set_exception(Closed(f"{self.topic} is closing"))
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer


def _chain(source: asyncio.Future[Position], target: asyncio.Future[Position]) -> None:
    def done(f: asyncio.Future[Position]) -> None:
        if target.done():
            return
        if f.cancelled():
            target.cancel()
        elif (err := f.exception()) is not None:
            target.set_exception(err)
        else:
            target.set_result(f.result())

    if source.done():
        done(source)
    else:
        source.add_done_callback(done)
