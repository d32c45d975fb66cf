"""Transaction ids: defined in ``core/txn_id.py`` (the client uses them too), re-exported.

Example:
    >>> TxnId(0, 7).least_bits
    7
"""

from __future__ import annotations

from anabranch.core.txn_id import TxnId

__all__ = ["TxnId"]
