"""Fusion decisions: every acceptance or refusal carries its reason.

Problem: a user reading `--explain` (or a test) must see why two ops were not fused — which
node, which limit — not a bare False.
Approach: as onnxscript's rewriter, a failed check returns its reason: `FusionDecision(False,
"smem 72.0 KiB > 64.0 KiB per block on t4")`. Truthiness is the verdict.
Invariants: a refusal always has a non-empty reason.
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
