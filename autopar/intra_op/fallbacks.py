"""Operators with no sharding rule: what the plan reports about each, and the warning."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from autopar.core._format import format_bytes
from autopar.core.errors import FallbackWarning


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallback:
    node: int
    primitive: str
    source: str
    reason: str
    replicated_bytes: int = 0     # whole non-scalar operands and results each device holds
    largest: str = ""             # the biggest of them, e.g. "operand float32[64, 64] (x['w'])"


def warn_fallback(f: Fallback) -> None:
    """A `FallbackWarning` for a fallback that replicates more than scalars (identical
    warnings print once per process under Python's default filter)."""
    if f.replicated_bytes > 0:
        warnings.warn(
            f"autopar: node {f.node} '{f.primitive}' at {f.source} is replicated: {f.reason}; "
            f"every device holds {format_bytes(f.replicated_bytes)} of its operands and "
            f"results whole{f' (the largest: {f.largest})' if f.largest else ''}. Fix: add a "
            f"sharding rule for '{f.primitive}' (LEADER_RULES in "
            f"autopar/intra_op/rules.py or FOLLOW_RULES in follow.py), or restructure the code "
            f"at that line; see the plan's fallbacks in autopar.dump.",
            FallbackWarning, stacklevel=2)


__all__ = ["Fallback", "warn_fallback"]
