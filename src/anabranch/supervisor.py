"""Background loops that are never lost: restarted when they die, fatal when they keep dying.

A broker runs long-lived loops (the cluster session guard and load reports, the scalable
controller's session guard, the keepalive timer, transaction sweeps and outcome watches).
An exception that ends one of them must not vanish into an unretrieved task: a
:class:`Supervised` loop that dies is logged with its traceback and started again (after a
short pause, through ``again`` when a restart needs to catch up first, e.g. a watch that
re-lists). One that dies ``max_restarts`` times within ``window_s`` is broken, not
unlucky: ``on_give_up`` runs — for a broker, :meth:`Fatal.fail`, which stops the process
with a non-zero exit status and a CRITICAL log line instead of limping on.

A loop that returns normally is finished and not restarted; cancelling it (``stop``) is
how its owner ends it.

Example:
    >>> async def demo() -> list[str]:
    ...     seen: list[str] = []
    ...     async def flaky() -> None:
    ...         seen.append("run")
    ...         if len(seen) < 3:
    ...             raise RuntimeError("boom")
    ...     loop = Supervised("flaky", flaky, restart_delay_s=0).start()
    ...     while len(seen) < 3:
    ...         await asyncio.sleep(0)
    ...     await loop.stop()
    ...     return seen
    >>> asyncio.run(demo())
    ['run', 'run', 'run']
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Loop = Callable[[], Awaitable[None]]
GiveUp = Callable[[str, BaseException], None]

RESTART_DELAY_S = 0.5
"""Pause before a restart, so a loop failing at once does not spin the event loop."""
MAX_RESTARTS = 10
WINDOW_S = 60.0
"""``MAX_RESTARTS`` deaths within ``WINDOW_S``: the loop is broken; give up."""


def _log_give_up(name: str, err: BaseException) -> None:
    log.critical("%s keeps dying; giving up on it", name, exc_info=err)


class Supervised:
    """One named loop kept running; see the module docstring."""

    def __init__(
        self,
        name: str,
        make: Loop,
        *,
        again: Loop | None = None,
        on_give_up: GiveUp | None = None,
        restart_delay_s: float = RESTART_DELAY_S,
        max_restarts: int = MAX_RESTARTS,
        window_s: float = WINDOW_S,
    ) -> None:
        self.name = name
        self._make = make
        self._again = again or make
        self._on_give_up = on_give_up or _log_give_up
        self._restart_delay_s = restart_delay_s
        self._max_restarts = max_restarts
        self._window_s = window_s
        self._deaths: collections.deque[float] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self.restarts = 0
        """How many times the loop was started again after dying (metrics, tests)."""
        self.gave_up = False

    def start(self) -> Supervised:
        """Start the loop on the running event loop; returns self."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
        return self

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        make = self._make
        while not self._stopped:
            try:
                await make()
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                if self._stopped:
                    return
                now = time.monotonic()
                self._deaths.append(now)
                while self._deaths and self._deaths[0] < now - self._window_s:
                    self._deaths.popleft()
                if len(self._deaths) > self._max_restarts:
                    self.gave_up = True
                    self._on_give_up(self.name, err)
                    return
                log.error("%s died; restarting it", self.name, exc_info=err)
                self.restarts += 1
                make = self._again
                await asyncio.sleep(self._restart_delay_s)

    def cancel(self) -> None:
        """Stop the loop without waiting for it."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        """Stop the loop and wait until it has ended."""
        self.cancel()
        task, self._task = self._task, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)


def report_death(task: asyncio.Task[object]) -> None:
    """Done-callback for a task whose death has a safe consequence of its own (a session
    keepalive: the session then expires by its deadline, which its holder handles): the
    exception is logged with its traceback instead of lost.

    Example:
        >>> async def demo() -> None:
        ...     task = asyncio.get_running_loop().create_task(asyncio.sleep(0))
        ...     task.add_done_callback(report_death)
        ...     await task
        >>> asyncio.run(demo())
    """
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died", task.get_name(), exc_info=task.exception())


class Fatal:
    """A broker-wide "something essential is broken": the process waits on :meth:`wait`
    beside its stop signal and exits non-zero when :meth:`fail` was called.

    Example:
        >>> async def demo() -> str:
        ...     fatal = Fatal()
        ...     fatal.fail("txn-sweeps", RuntimeError("disk gone"))
        ...     return await fatal.wait()
        >>> asyncio.run(demo())
        'txn-sweeps: disk gone'
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.reason: str | None = None

    def fail(self, name: str, err: BaseException) -> None:
        """Record the first fatal failure (later ones are only logged)."""
        log.critical("%s keeps dying; stopping the broker", name, exc_info=err)
        if self.reason is None:
            self.reason = f"{name}: {err}"
            self._event.set()

    @property
    def failed(self) -> bool:
        return self.reason is not None

    async def wait(self) -> str:
        """The reason, once :meth:`fail` was called."""
        await self._event.wait()
        assert self.reason is not None
        return self.reason
