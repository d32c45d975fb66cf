"""When a Shared or Key_Shared consumer or subscription holds too many unacknowledged
messages to be sent more (Pulsar's ``maxUnackedMessagesPerConsumer`` and
``maxUnackedMessagesPerSubscription``).

Upstream's rule, with its hysteresis: the gate closes once the unacknowledged count
reaches the cap, and opens again only when acknowledgements bring it down to half of the
cap (at or below half for a consumer, strictly below for a subscription, as upstream), so
a consumer at the cap is not sent one message per ack. A cap of 0 is no cap.

Example:
    >>> gate = UnackedGate(cap=10)
    >>> gate.closed(9), gate.closed(10), gate.closed(6), gate.closed(5)
    (False, True, True, False)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class UnackedGate:
    """One consumer's or subscription's gate (see the module docstring)."""

    cap: int = 0
    """Unacknowledged messages at which the gate closes; 0: never."""
    reopen_at_half: bool = True
    """Open again at exactly half (a consumer's rule); False: only below half."""
    is_closed: bool = False

    def closed(self, unacked: int) -> bool:
        """Whether nothing more may be sent, with ``unacked`` messages held now."""
        cap = self.cap
        if cap <= 0:
            self.is_closed = False
        elif self.is_closed:
            half = cap // 2
            self.is_closed = unacked > half if self.reopen_at_half else unacked >= half
        else:
            self.is_closed = unacked >= cap
        return self.is_closed
