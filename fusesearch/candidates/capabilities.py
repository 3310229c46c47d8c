"""What a code generator writes, as legality reads it: a value handed to `Legality`, so the
candidates never import the generator.

Problem: a fused group is a candidate only if the generator writes it (every op has code, every
tensor a C type; on a CPU, in a form the C backend writes well enough to be worth fusing), yet the
generator sits above legality: it reads lowering's kernels and writes their sources.
Approach: the generator describes itself once as `Capabilities`: the op types it has code for, the
dtypes it has a C type for, and its CPU acceptance predicate. `fusesearch.backends.codegen` builds
it (`CAPABILITIES`); whoever binds the rules to a graph passes it to `Legality` (the search
problem, calibrate, the CLI's plan file check), and the `generatable` and `fits-device` rules read
it from there.
Invariants: frozen; `generatable` decides from ops and dtypes alone (cheap enough for every
candidate); every refusal names the op or tensor and says it runs alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fusesearch.groups import FusionDecision

if TYPE_CHECKING:
    from fusesearch.ir.graph import Graph
    from fusesearch.lowering import Kernel


@dataclass(frozen=True)
class Capabilities:
    ops: frozenset[str]  # op types the generator has code for
    dtypes: frozenset[str]  # tensor dtypes it has a C type for
    cpu_fusable: Callable[[Graph, Kernel], FusionDecision]  # a fused group the C backend writes well
    blas: bool = True  # a CPU program links a BLAS: the "blas" and "im2col" products exist only then

    def generatable(self, graph: Graph, kernel: Kernel) -> FusionDecision:
        """Whether the generator can write the kernel at all: each op has code and each tensor a
        C type. A group that passes may still be refused by an op's attributes (the generator
        says which when it writes it)."""
        for i in kernel.nodes:
            n = graph.nodes[i]
            if n.op_type not in self.ops:
                return FusionDecision.refuse(f"{n.name}({n.op_type}) has no code generator: it runs alone")
        for t in (*kernel.inputs, *kernel.outputs):
            if graph.tensors[t].dtype not in self.dtypes:
                return FusionDecision.refuse(f"dtype {graph.tensors[t].dtype} of '{t}' is not generated: its ops run alone")
        return FusionDecision.accept()
