"""A fusion verdict with its reason: the leaf type every legality check, lowering and backend returns.

Invariants: frozen; a refusal always has a non-empty reason; truthy exactly when accepted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusionDecision:
    ok: bool
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.ok and not self.reason:
            raise ValueError("a refused FusionDecision needs a reason")

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def accept(cls, reason: str = "") -> FusionDecision:
        return cls(True, reason)

    @classmethod
    def refuse(cls, reason: str) -> FusionDecision:
        return cls(False, reason)
