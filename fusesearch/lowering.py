"""Lower a FusionGroup to a Kernel: one template, its ops in order, and the numbers a cost model needs.

Problem: the cost model (`costmodels`) knows kernels, not graphs; one place decides a group's code
shape and counts its work and traffic, the same for search, reports and the code generator.
Approach: checks first (each refusal a `FusionDecision` with its reason), then the template: an
OPAQUE op alone → `opaque` (a library call); one anchor → `conv`, `depthwise`, `conv_disjoint`
(`schedule.depthwise_conv`, `schedule.disjoint_windows`) or `gemm`, with prologue/epilogue (a row
Softmax included); REDUCE without anchor → `rowwise`; the rest `pointwise`. `choices` lists every
`Schedule` (default first; `host=True` for CPU products and splits), the search keeps the cheapest
(`costing.cheapest`); `nchwc_choices` the blocked form apart (two anchors: a chain, blocked only,
`schedule.anchor_chain`). Traffic is compulsory (blocked tensors padded; a Gather table its rows);
prologues charged per reload, ops under a pool per tap; a lone view is a zero-cost alias.
Invariants: a Kernel's `nodes` are in topological order; `inputs`/`outputs` are distinct and in
first-use order; the same group always lowers to the same Kernel; a pool the generator does not
take is refused (it runs alone, opaque)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from costmodels import DTYPE_BYTES, KernelSpec
from fusesearch.errors import FusesearchError
from fusesearch.groups import FusionDecision, FusionGroup
from fusesearch.ir.graph import Graph, Node
from fusesearch.ir.op_kind import OpKind, node_flops, node_transcendentals
from fusesearch.ir.pool import POOL_OPS, pool_window
from fusesearch.layout import NCHW, NHWC, Layout
from fusesearch.schedule import (
    ALIAS,
    CHAIN,
    DEPTHWISE,
    LIBRARY,
    MAX_GRID_YZ,
    MMA_ELEMENT_BYTES,
    MMA_SYNC_SKELETONS,
    MMA_THREADS,
    ONE_PASS,
    ONE_THREAD,
    PACKED,
    REORDER_SQUARE,
    THREADS,
    VIEW_OPS,
    Chain,
    CpuTarget,
    Schedule,
    a_load_elements,
    activation_sectors,
    anchor_chain,
    anchor_derived,
    block_per_row,
    chain_items,
    conv_reads_band,
    cpu_products,
    cpu_splits,
    cudnn_epilogue,
    depthwise_conv,
    disjoint_windows,
    epilogues,
    folded_scale,
    gelu_chains,
    gemm_blocks_dims,
    gemm_products,
    gemm_tiles,
    grid_stride,
    has_gemm_view,
    library_tiles,
    mma,
    mma_sync,
    mma_sync_split,
    mma_sync_tiles,
    mma_tiles,
    nchwc_conv,
    nchwc_input,
    nchwc_items,
    nchwc_pointwise,
    nhwc_conv,
    one_pass_moments,
    one_thread_forms,
    prologue_forms,
    prologue_splits,
    reorder_grid,
    row_prologue,
    scaled_product,
    split_blocks,
    split_choices,
    split_imbalance,
    split_k,
    split_k_workspace,
    stride_blocks,
    tensor_core_skeleton,
    tensor_layouts,
    thread_layout,
    tuned_choice,
    vectorizable,
)

MAX_ROW_TILE = 8192  # a Softmax epilogue row longer than this cannot be one tile
# Only these: a LayerNorm (whole or decomposed) over a projection's rows was tried as a row
# epilogue on the CPU (the product over packed weights into a buffer, then the row loops) and
# measured within noise of its statistics kernel plus the next product's prologue (bert-small,
# vit-small, bert-base: 0.99-1.07x, interleaved), with a GPU skeleton (a block per row) unmeasured
ROW_EPILOGUE_OPS = frozenset({"Softmax", "LogSoftmax"})
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
HALF_DTYPES = frozenset({"float16", "bfloat16"})
GEMM_TEMPLATE = {"Conv": "conv", "ConvTranspose": "conv", "MatMul": "gemm", "Gemm": "gemm"}


class CannotLower(FusesearchError):
    def __init__(self, decision: FusionDecision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


@dataclass(frozen=True)
class Kernel:
    template: str
    nodes: tuple[int, ...]
    ops: tuple[str, ...]
    anchor: int | None
    dtype: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    iteration_size: int
    reduction_length: int
    live_values: int
    tc_flops: int
    scalar_flops: int
    transcendentals: int
    read_bytes: int
    write_bytes: int
    schedule: Schedule
    index_divisions: int = 0  # per element: divisions / modulos by non-power-of-two constants
    divisions: int = 0  # floating-point divisions and square roots (elements of Div, Sqrt, ...)
    imbalance: float = 1.0  # a CPU gemm: its busiest thread's work over an even share (`schedule.split_imbalance`)
    staged_loads: int = 0  # a generated GPU conv: the loads its A staging issues (`_with_staging`)

    # how it runs: the schedule's, decided once (see fusesearch.schedule)
    @property
    def impl(self) -> str:
        """"library" for a lone anchor or an opaque op (they run as a vendor library call, in
        `measure` and in what a user would otherwise run), "generated" for everything else (a
        lone view, an alias, is "generated" here: `alias` says it needs no kernel)."""
        return "library" if self.schedule.impl == "library" else "generated"

    @property
    def alias(self) -> bool:
        return self.schedule.impl == "alias"

    @property
    def tile(self) -> tuple[int, ...]:
        return self.schedule.tile

    @property
    def smem_bytes(self) -> int:
        return self.schedule.smem_bytes

    @property
    def threads_per_block(self) -> int:
        return self.schedule.threads

    @property
    def split_k(self) -> int:
        return self.schedule.split_k

    @property
    def blocks(self) -> int:
        return self.schedule.blocks

    def spec(self) -> KernelSpec:
        return KernelSpec(
            template=self.template, dtype=self.dtype if self.dtype in DTYPE_BYTES else "float32",
            tc_flops=float(self.tc_flops), scalar_flops=float(self.scalar_flops),
            transcendentals=float(self.transcendentals), dram_read_bytes=float(self.read_bytes),
            dram_write_bytes=float(self.write_bytes), iteration_size=self.iteration_size,
            reduction_length=self.reduction_length, tile=self.tile, smem_bytes=self.smem_bytes,
            live_values_per_thread=self.live_values, threads_per_block=self.threads_per_block,
            num_ops=len(self.ops), op_types=self.ops, index_divisions=self.index_divisions,
            divisions=float(self.divisions), staged_loads=float(self.staged_loads), impl=self.impl, blocks=self.blocks, unit=self.schedule.unit,
            min_arch=self.schedule.min_arch, product=self.schedule.product, imbalance=self.imbalance,
            cpu_threads=self.schedule.cpu_threads, mma_sync=self.schedule.skeleton in MMA_SYNC_SKELETONS.values())


def lower(graph: Graph, group: FusionGroup) -> Kernel:
    """The group's default Kernel (`try_lower`), or `CannotLower` carrying the refusal's reason."""
    result = try_lower(graph, group)
    if isinstance(result, FusionDecision):
        raise CannotLower(result)
    return result


def try_lower(graph: Graph, group: FusionGroup, *, host: bool | CpuTarget = False) -> Kernel | FusionDecision:
    """The group's default choice (the first of `choices`: a library's heuristic tile, tensor
    cores where the operands have them; on a CPU a gemm/conv's C), or the refusal. A plan's kernel
    is the cheapest choice on its device (`costing.cheapest`), not necessarily this one."""
    result = choices(graph, group, host=host)
    return result if isinstance(result, FusionDecision) else result[0]


def choices(graph: Graph, group: FusionGroup, *, host: bool | CpuTarget = False,
            tuned: Sequence[tuple[str, str, tuple[int, ...]]] = ()) -> tuple[Kernel, ...] | FusionDecision:
    """Every schedule the group can run as, each a Kernel the cost model prices and the generator
    writes as given, the default first (ties keep it). `host`: as a CPU runs it (an anchor, fused
    or alone, as the C backend's `packed`/`depthwise`, once per C product it can run as,
    `schedule.cpu_products` for the `CpuTarget` given (True: one that links a BLAS, as the C
    backend does), a lone one also as the library call; at a target of more than one thread each
    generated form of the default split also on one thread, last: `schedule.one_thread_forms`); else
    as a GPU does: a fused gemm/conv at each tensor-core tile (`schedule.mma_tiles`, where its
    operands have tensor cores) and each CUDA-core tile (`schedule.gemm_tiles`), or `direct`
    where no tile applies; a lone one as the library call (its split-K) and then as those
    generated forms. Every other group has one schedule. A lone op without a template runs as a
    library call. `tuned`: a device's tuned tile table (`DeviceSpec.tuned_tiles`): where it has
    a row for a tensor-core skeleton at the group's shape class, that configuration alone."""
    nodes = [graph.nodes[i] for i in sorted(group.nodes)]
    target = CpuTarget() if host is True else host or None
    result = _lower_checked(graph, nodes, target, tuple(tuned))
    if isinstance(result, FusionDecision) and len(nodes) == 1:
        return (_lower_opaque(graph, nodes),)
    if target is None or isinstance(result, FusionDecision):
        return result
    return with_one_thread_forms(result, target)


def with_one_thread_forms(kernels: Sequence[Kernel], target: CpuTarget) -> tuple[Kernel, ...]:
    """`kernels` and after them the one-thread form (split ONE_THREAD, no imbalance) of each
    that `schedule.one_thread_forms` names for `target` (none at one thread)."""
    serial = one_thread_forms([k.schedule for k in kernels], target)
    return (*kernels, *(replace(kernels[i], schedule=replace(kernels[i].schedule, split=ONE_THREAD), imbalance=1.0)
                        for i in serial))


def _lower_checked(graph: Graph, nodes: list[Node], host: CpuTarget | None = None,
                   tuned: tuple = ()) -> tuple[Kernel, ...] | FusionDecision:
    for check in (_check_opaque, _check_shapes, _check_connected_convex, _check_anchor, _check_dtype,
                  _check_windows):
        decision = check(graph, nodes)
        if not decision:
            return decision
    return _lower_template(graph, nodes, host, tuned)


def _lower_template(graph: Graph, nodes: list[Node], host: CpuTarget | None = None,
                    tuned: tuple = ()) -> tuple[Kernel, ...] | FusionDecision:
    anchors = [n for n in nodes if n.kind == OpKind.ANCHOR]
    if anchors:
        return _anchor_choices(graph, nodes, anchors[0], host, tuned)
    if any(n.kind == OpKind.REDUCE for n in nodes):
        result = _lower_rowwise(graph, nodes, host is not None)
    elif nodes[0].kind == OpKind.OPAQUE:
        result = _lower_opaque(graph, nodes)
    else:
        result = _lower_pointwise(graph, nodes)
    return result if isinstance(result, FusionDecision) else (result,)


def lower_as_library(graph: Graph, group: FusionGroup) -> Kernel:
    """A lone op run by a library call (`opaque`), whatever its kind."""
    return _lower_opaque(graph, [graph.nodes[i] for i in sorted(group.nodes)])


def _lower_opaque(graph: Graph, nodes: list[Node]) -> Kernel:
    return _build(graph, nodes, "opaque", None, _largest_output(graph, nodes), 0, _live_values(graph, nodes),
                  LIBRARY)


# -- checks -----------------------------------------------------------------------------------

def _label(n: Node) -> str:
    return f"{n.name}({n.op_type})"


def _check_opaque(graph: Graph, nodes: list[Node]) -> FusionDecision:
    opaque = [n for n in nodes if n.kind == OpKind.OPAQUE]
    if opaque and len(nodes) > 1:
        return FusionDecision.refuse(f"{_label(opaque[0])} is opaque and runs alone")
    return FusionDecision.accept()


def _check_shapes(graph: Graph, nodes: list[Node]) -> FusionDecision:
    if len(nodes) == 1 and nodes[0].kind == OpKind.OPAQUE:
        return FusionDecision.accept()
    for n in nodes:
        for t in n.inputs + n.outputs:
            info = graph.info(t)
            if t and (info is None or info.shape is None):
                return FusionDecision.refuse(f"shape of '{t}' ({_label(n)}) is not static; bind dims "
                                             "with --dim / --input-shape")
    return FusionDecision.accept()


def _check_connected_convex(graph: Graph, nodes: list[Node]) -> FusionDecision:
    if len(nodes) == 1:
        return FusionDecision.accept()
    ids = {n.id for n in nodes}
    parent = {i: i for i in ids}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for n in nodes:
        for p in graph.predecessors(n.id):
            if p in ids:
                parent[find(p)] = find(n.id)
    if len({find(i) for i in ids}) > 1:
        return FusionDecision.refuse("group is not connected")
    if not graph.is_convex(ids):
        return FusionDecision.refuse("group is not convex (a path leaves it and comes back)")
    return FusionDecision.accept()


def _check_anchor(graph: Graph, nodes: list[Node]) -> FusionDecision:
    anchors = [n for n in nodes if n.kind == OpKind.ANCHOR]
    if len(anchors) > 1:
        return FusionDecision.refuse(f"two anchors: {_label(anchors[0])} and {_label(anchors[1])}")
    return FusionDecision.accept()


def _check_dtype(graph: Graph, nodes: list[Node]) -> FusionDecision:
    """One float dtype per group, except that float32 mixes with one half dtype: generated code
    computes in float32 and half is storage only (a half model keeps LayerNorm and Softmax in
    float32, between Casts, and they fuse with their half neighbours)."""
    dtypes = {graph.tensors[t].dtype for n in nodes if n.op_type != "Cast" for t in n.outputs
              if t and graph.tensors[t].dtype in FLOAT_DTYPES}
    if len(dtypes - {"float32"}) > 1 or ("float64" in dtypes and len(dtypes) > 1):
        return FusionDecision.refuse(f"mixed dtypes {'/'.join(sorted(dtypes))} in one group")
    return FusionDecision.accept()


def _pool_window(graph: Graph, n: Node):
    return pool_window(n.op_type, n.attrs, graph.tensors[n.inputs[0]].shape, graph.tensors[n.outputs[0]].shape,
                       graph.tensors[n.inputs[0]].dtype, sum(1 for t in n.outputs if t))


def _check_windows(graph: Graph, nodes: list[Node]) -> FusionDecision:
    """A pool is generated only as `ir.pool` describes it (alone, the others run as library calls)."""
    for n in nodes:
        if n.op_type in POOL_OPS:
            window = _pool_window(graph, n)
            if isinstance(window, str):
                return FusionDecision.refuse(f"{_label(n)}: {window}")
    return FusionDecision.accept()


# -- templates --------------------------------------------------------------------------------

def _largest_output(graph: Graph, nodes: list[Node]) -> int:
    return max((graph.tensors[t].size for n in nodes for t in n.outputs if t), default=0)


def _live_values(graph: Graph, nodes: list[Node]) -> int:
    """Register-pressure proxy for elementwise work: index math plus one value per op and per
    external input held at once (a fused chain keeps its intermediates in registers)."""
    return 4 + len(nodes) + len(external_inputs(graph, nodes))


def _lower_pointwise(graph: Graph, nodes: list[Node]) -> Kernel:
    ids, outputs = [n.id for n in nodes], _external_outputs(graph, nodes)
    written = max((graph.tensors[t].size for t in outputs), default=1)  # the loop covers every output
    if len(nodes) == 1 and nodes[0].op_type in VIEW_OPS:
        schedule = ALIAS
    elif vectorizable(graph, ids, external_inputs(graph, nodes), outputs):
        schedule = Schedule("generated", "vectorized", "cuda-core", grid=(stride_blocks(written // 4), 1, 1))
    else:
        schedule = grid_stride(written)
    return _build(graph, nodes, "pointwise", None, _largest_output(graph, nodes), 0, _live_values(graph, nodes),
                  schedule)


def reduced_rows(graph: Graph, n: Node) -> tuple[int, int] | FusionDecision:
    """(rows, row length) of a REDUCE node, refused when it reduces a non-inner axis."""
    shape = graph.tensors[n.inputs[0]].shape
    rank = len(shape)
    axes = _reduce_axes(graph, n, rank)
    if axes is None:
        return FusionDecision.refuse(f"{_label(n)} has no row-wise lowering")
    axes = sorted(a % rank for a in axes) if rank else []
    if axes != list(range(rank - len(axes), rank)):
        return FusionDecision.refuse(f"{_label(n)} reduces axes {axes}, not the innermost ones")
    split = rank - len(axes)
    return math.prod(shape[:split]), math.prod(shape[split:])


def _reduce_axes(graph: Graph, n: Node, rank: int) -> list[int] | None:
    a = n.attrs
    if n.op_type in ("Softmax", "LogSoftmax", "Hardmax"):
        return [int(a.get("axis", -1))]
    if n.op_type in ("ArgMax", "ArgMin"):
        return [int(a.get("axis", 0))]
    if n.op_type in ("LayerNormalization", "RMSNormalization"):
        axis = int(a.get("axis", -1)) % max(rank, 1)
        return list(range(axis, rank))
    if n.op_type == "MeanVarianceNormalization":
        return [int(x) for x in a.get("axes", (0, 2, 3))]
    if n.op_type in ("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", "InstanceNormalization"):
        return list(range(2, rank))
    if n.op_type == "LpNormalization":
        return [int(a.get("axis", -1))]
    if n.op_type.startswith("Reduce"):
        return _reduce_op_axes(graph, n, rank)
    return None


def _reduce_op_axes(graph: Graph, n: Node, rank: int) -> list[int] | None:
    if "axes" in n.attrs:
        return [int(x) for x in n.attrs["axes"]]
    if len(n.inputs) > 1 and n.inputs[1]:
        axes = graph.constant_value(n.inputs[1])
        if axes is None:
            return None
        if axes.size:
            return [int(x) for x in axes.reshape(-1)]
    return [] if n.attrs.get("noop_with_empty_axes", 0) else list(range(rank))


def _lower_rowwise(graph: Graph, nodes: list[Node], host: bool = False) -> Kernel | FusionDecision:
    """A row kernel (`schedule.block_per_row`); on a CPU its statistics in one pass where it holds
    a row variance (`schedule.one_pass_moments`: the same FLOPs and DRAM bytes, one read of each
    row fewer, which the roofline does not see)."""
    shapes = set()
    for n in nodes:
        if n.kind != OpKind.REDUCE:
            continue
        rows = reduced_rows(graph, n)
        if isinstance(rows, FusionDecision):
            return rows
        shapes.add(rows)
    if len({r for r, _ in shapes}) > 1:
        return FusionDecision.refuse(f"reductions over different row counts {sorted(shapes)}")
    rows, row_len = max(shapes, key=lambda s: s[1])
    for check in (_row_outputs_fit, _rows_stay_rows):
        decision = check(graph, nodes, rows, row_len)
        if not decision:
            return decision
    live = _live_values(graph, nodes) + min(32, math.ceil(row_len / THREADS))
    ids = [n.id for n in nodes]
    schedule = block_per_row(graph, ids, rows, row_len)
    if host and one_pass_moments(graph, ids):
        schedule = replace(schedule, moments=ONE_PASS)
    return _build(graph, nodes, "rowwise", None, rows * row_len, row_len, live, schedule)


def _row_outputs_fit(graph: Graph, nodes: list[Node], rows: int, row_len: int) -> FusionDecision:
    """Every output that depends on a reduction is one value per row or per row element."""
    reduce_ids = [n.id for n in nodes if n.kind == OpKind.REDUCE]
    for t in _external_outputs(graph, nodes):
        size = graph.tensors[t].size
        producer = graph.producer(t)
        after = any(r == producer or graph.reaches(r, producer) for r in reduce_ids)
        if after and size not in (rows, rows * row_len):
            return FusionDecision.refuse(f"output '{t}' ({size} values) is neither one per row ({rows}) "
                                         f"nor one per element ({rows * row_len}) of the rows")
    return FusionDecision.accept()


def _rows_stay_rows(graph: Graph, nodes: list[Node], rows: int, row_len: int) -> FusionDecision:
    """Every value computed from a reduction keeps its row. The generator writes row r's elements
    from row r's reduced scalars, so each node reading a value after a reduction must read it at
    its own row: a view (Reshape, Flatten, Squeeze, Unsqueeze: the flat position stays) or a
    pointwise op whose reduction-dependent operands span the output's row axes (a per-row mean
    broadcast along the row). A node that moves elements (Gather, Transpose, Slice, Concat, ...)
    or a broadcast that lays per-row values along another axis would combine another row's
    elements with this row's scalars; refused, naming the node, even where its output happens to
    hold one value per row (BERT's pooler Gather of the first token after the final LayerNorm,
    seq = hidden)."""
    sizes = {rows, rows * row_len}
    after: set[str] = set()  # tensors computed from a reduction
    for n in nodes:
        read = [t for t in n.inputs if t in after]
        if n.kind == OpKind.REDUCE:
            moved = [t for t in read if t != n.inputs[0]]
        elif read:
            moved = _moved_rows(graph, n, read, rows, sizes)
        else:
            continue
        if moved:
            return FusionDecision.refuse(f"{_label(n)} reads '{moved[0]}' (computed from a reduction) at another "
                                         f"row's position: a row kernel writes each row from its own reductions")
        after.update(t for t in n.outputs if t)
    return FusionDecision.accept()


def _moved_rows(graph: Graph, n: Node, read: list[str], rows: int, sizes: set[int]) -> list[str]:
    """The reduction-dependent inputs `read` that `n` (not a reduction) reads away from their row."""
    out = graph.tensors[n.outputs[0]].shape
    if any(graph.tensors[t].size not in sizes for t in n.outputs if t):
        return read
    if n.op_type in VIEW_OPS or n.op_type == "Identity":
        return []
    if n.kind not in (OpKind.ELEMWISE, OpKind.BROADCAST):
        return read
    splits = [s for s in range(len(out) + 1) if math.prod(out[:s]) == rows]

    def kept(t: str) -> bool:
        shape = graph.tensors[t].shape
        padded = (1,) * (len(out) - len(shape)) + tuple(shape)
        return padded == tuple(out) or any(padded[:s] == tuple(out[:s]) for s in splits)

    return [t for t in read if not kept(t)]


def _gemm_dims(graph: Graph, anchor: Node) -> tuple[int, int, int]:
    """(M, N, K) of the anchor as a GEMM (implicit GEMM for convolutions; M spans batch)."""
    ins = [graph.tensors[t].shape if t else None for t in anchor.inputs]
    out = graph.tensors[anchor.outputs[0]].shape
    if anchor.op_type == "Conv":
        w = ins[1]
        group = int(anchor.attrs.get("group", 1))
        return math.prod(out) // out[1], out[1] // group, math.prod(w[1:])
    if anchor.op_type == "ConvTranspose":
        w = ins[1]
        group = int(anchor.attrs.get("group", 1))
        return math.prod(out) // out[1], out[1] // group, w[0] // group * math.prod(w[2:])
    if anchor.op_type == "Gemm":
        a = ins[0]
        k = a[0] if anchor.attrs.get("transA", 0) else a[-1]
        return out[0], out[1], k
    a = ins[0]
    k = a[-1]
    n = out[-1] if len(out) >= 1 else 1
    return math.prod(out) // max(n, 1), n, k


def _tile_batches(graph: Graph, anchor: Node) -> tuple[int, int]:
    """(z, M per z) of the generated tiled kernel: MatMul batches or Conv groups on grid z."""
    out = graph.tensors[anchor.outputs[0]].shape
    if anchor.op_type == "MatMul" and len(out) >= 2:
        return math.prod(out[:-2]), out[-2]
    if anchor.op_type == "Conv":
        return int(anchor.attrs.get("group", 1)), math.prod(out) // out[1]
    m, _, _ = _gemm_dims(graph, anchor)
    return 1, m


def _anchor_choices(graph: Graph, nodes: list[Node], anchor: Node,
                    host: CpuTarget | None, tuned: tuple = ()) -> tuple[Kernel, ...] | FusionDecision:
    ids = [n.id for n in nodes]
    prologue = row_prologue(graph, ids, anchor)
    if prologue:
        decision = _row_prologue_fits(graph, nodes, anchor, prologue, host)
        if not decision:
            return decision
    row_tile = 0
    for n in nodes:
        if n.kind == OpKind.REDUCE and n.id not in prologue:
            decision = _row_epilogue(graph, n, anchor)
            if isinstance(decision, FusionDecision):
                return decision
            row_tile = max(row_tile, decision)
    m, n_dim, k = _gemm_dims(graph, anchor)
    out_size = graph.tensors[anchor.outputs[0]].size
    template = anchor_template(graph, anchor)
    if host:  # the CPU's C: packed panels, each prologue element once (per tap), or a depthwise
        # conv's loop over its planes (each prologue element once), one choice per product the
        # group can run as (`schedule.cpu_products`); a lone anchor also the library's
        skeleton = DEPTHWISE if template == "depthwise" else PACKED  # each product priced as itself
        if prologue:  # the rows' statistics as the rows' own kernel takes them
            skeleton = replace(skeleton, moments=ONE_PASS if one_pass_moments(graph, prologue) else "")
        products = tuple(_cpu_split(graph, nodes, anchor, _build(
                             graph, nodes, template, anchor.id, out_size, k, 4 + 2 * len(nodes),
                             replace(skeleton, product=p, epilogue=where, split=split, prologue=form),
                             reload_tile=(m, n_dim, k), host=True), host)
                         for p in cpu_products(graph, ids, anchor, host, row_epilogue=bool(row_tile))
                         if not prologue or p == "own"
                         for where in epilogues(graph, ids, anchor, p, host.lanes)
                         for form in prologue_forms(graph, ids, anchor) or ("",)
                         for split in prologue_splits(graph, ids, anchor, form, cpu_splits(
                             graph, ids, anchor, p, host, row_epilogue=bool(row_tile))))
        if len(nodes) > 1:
            return products
        # the library's threads share the same work in tiles as well: priced at our best split's balance
        tile = gemm_tiles(m, n_dim)[0]
        library = _library_anchor(graph, nodes, anchor, m, n_dim, k, tile, split=split_k(m, n_dim, k, tile))
        return (*products, replace(library, imbalance=min(kn.imbalance for kn in products)))
    if row_tile:  # generated as a row kernel: a block per row, the product's row cached in shared
        live = 24 + 2 * (len(nodes) - 1)  # memory (and a Softmax's exponentials); a thread's slice
        schedule = block_per_row(graph, ids, out_size // row_tile, row_tile, tile=(1, row_tile, k))
        return (_build(graph, nodes, template, anchor.id, out_size, k, live, schedule),)
    generated = (_tensor_core_choices(graph, nodes, anchor, template, tuned)
                 + _cuda_core_choices(graph, nodes, anchor, template))
    cudnn = cudnn_epilogue(graph, [n.id for n in nodes], anchor)

    def library(call: str) -> tuple[Kernel, ...]:  # the cheapest of them: its heuristic splits K where that pays
        return tuple(_library_anchor(graph, nodes, anchor, m, n_dim, k, t, call, ways) for t in library_tiles(m, n_dim)
                     for ways in split_choices(split_k(m, n_dim, k, t)))

    if len(nodes) > 1:  # a conv + bias + activation also as one cuDNN graph: the library, fused epilogue
        return generated if cudnn is None else (*generated, *library("cudnn-fused"))
    return (*library("cudnn" if cudnn else ""), *generated)


def _row_prologue_fits(graph: Graph, nodes: list[Node], anchor: Node, prologue: tuple[int, ...],
                       host: CpuTarget | None) -> FusionDecision:
    """A row prologue (`schedule.row_prologue`: a LayerNorm before its projection, statistics and
    normalisation in the C kernel's rows, stored first or packed per block: `schedule.prologue_forms`;
    the product's blocks read them in the same OpenMP region): on a CPU only, before a MatMul (a
    Gemm: A not transposed) whose activation the rows compute over its K-long rows, with no row
    epilogue beside it and an epilogue at the product's positions (`anchor_derived`: the blocks
    store their tiles, no scratch product), through our micro-kernel."""
    label = _label(anchor)
    if host is None:
        return FusionDecision.refuse(f"a row reduction before {label} is fused on a CPU only")
    a = anchor.inputs[0]
    by_rows = anchor.op_type == "MatMul" or anchor.op_type == "Gemm" and not int(anchor.attrs.get("transA", 0))
    if not by_rows or graph.producer(a) not in prologue:
        return FusionDecision.refuse(f"the row reduction before {label} does not compute its activation")
    if any(n.kind == OpKind.REDUCE and n.id not in prologue for n in nodes):
        return FusionDecision.refuse(f"{label} has row reductions before and after it")
    if anchor_derived(graph, [n.id for n in nodes], anchor) is None:
        return FusionDecision.refuse(f"the epilogue of {label} moves the product's elements: a row prologue "
                                     "runs before blocks that store their tile in place")
    rows = _lower_rowwise(graph, [graph.nodes[i] for i in prologue], True)
    if isinstance(rows, FusionDecision):
        return rows
    shape = graph.tensors[a].shape
    if rows.reduction_length != shape[-1] or rows.iteration_size != math.prod(shape):
        return FusionDecision.refuse(f"the rows before {label} are not the rows of its activation '{a}'")
    if "own" not in gemm_products(graph, anchor, host.blas):
        return FusionDecision.refuse(f"{label}: a row prologue runs with our micro-kernel only, which this "
                                     "product is outside")
    return FusionDecision.accept()


def _cpu_split(graph: Graph, nodes: list[Node], anchor: Node, kernel: Kernel, host: CpuTarget) -> Kernel:
    """A CPU gemm choice priced for its thread split: its imbalance (`schedule.split_imbalance`),
    and, where the split makes column blocks, its activation's prologue recomputed once per column
    block (each packs its rows of A again, a packed row prologue's included; not a stored one's,
    whose rows store A once before the blocks); a conv or the per-row loops as they are."""
    if kernel.schedule.product not in ("own", "blas") or anchor.op_type not in ("MatMul", "Gemm"):
        return kernel
    batches, m, n = gemm_blocks_dims(graph, anchor)
    split = kernel.schedule.split
    _, _, cols, nb = split_blocks(split, batches, m, n, max(1, host.threads))
    if cols > 1 and kernel.schedule.prologue != "stored":  # a stored row prologue stores A once
        kernel = replace(_build(graph, nodes, kernel.template, anchor.id, kernel.iteration_size, kernel.reduction_length,
                                kernel.live_values, kernel.schedule, reload_tile=(batches * m, nb, kernel.reduction_length),
                                host=True), schedule=kernel.schedule)
    return replace(kernel, imbalance=split_imbalance(split, batches, m, n, host))


def nchwc_choices(graph: Graph, group: FusionGroup, host: CpuTarget) -> tuple[Kernel, ...]:
    """The group's forms in the target's blocked layout (`layout.Layout` of its `channel_block`):
    a conv group `schedule.nchwc_conv` accepts as product "nchwc" (its input as
    `schedule.nchwc_input` says: an image's few channels stay NCHW), an anchorless one
    `schedule.nchwc_pointwise` accepts (a pool, an activation, a residual Add, an upsample, a
    concat of whole blocks) with its tensors blocked; each priced with its padding (`_with_layouts`); above one thread each also as its
    one-thread form, last (`with_one_thread_forms`, as `choices`); () where none applies (a
    target without a block, another group, an illegal one). Kept apart from `choices` while plans
    hold NCHW only: a plan's programs feed every kernel the model's layout."""
    block = host.channel_block
    nodes = [graph.nodes[i] for i in sorted(group.nodes)]
    anchors = [n for n in nodes if n.kind == OpKind.ANCHOR]
    if block and len(anchors) > 1:
        return _chain_choices(graph, nodes, Layout(block), host)
    if (not block or (not anchors and not nchwc_pointwise(graph, group.nodes, block))
            or (anchors and (len(anchors) != 1 or not nchwc_conv(graph, group.nodes, anchors[0])))
            or isinstance(_lower_checked(graph, nodes, host), FusionDecision)):  # the cheap checks first
        return ()
    layout = Layout(block)
    if not anchors:
        kernel = _lower_pointwise(graph, nodes)
        schedule = Schedule("generated", "grid-stride", "cpu-simd", threads=1, layout_in=layout, layout_out=layout)
        return with_one_thread_forms((_with_layouts(graph, replace(kernel, schedule=schedule), None),), host)
    anchor = anchors[0]
    template = anchor_template(graph, anchor)
    schedule = replace(DEPTHWISE if template == "depthwise" else PACKED, product="nchwc",
                       layout_in=nchwc_input(graph, anchor, layout), layout_out=layout)
    m, n_dim, k = _gemm_dims(graph, anchor)
    kernel = _build(graph, nodes, template, anchor.id, graph.tensors[anchor.outputs[0]].size, k, 4 + 2 * len(nodes),
                    schedule, reload_tile=(m, n_dim, k), host=True)
    items = nchwc_items(block, template == "depthwise", graph.tensors[anchor.inputs[0]].shape,
                        graph.tensors[anchor.outputs[0]].shape,
                        (*graph.tensors[anchor.inputs[1]].shape[2:], *(anchor.attrs.get("strides") or (1, 1))),
                        any(anchor.attrs.get("pads") or ()))
    kernel = replace(kernel, imbalance=items.imbalance(max(1, host.threads)))
    return with_one_thread_forms((_with_layouts(graph, kernel, anchor),), host)


def _chain_choices(graph: Graph, nodes: list[Node], layout: Layout, host: CpuTarget) -> tuple[Kernel, ...]:
    """An NCHWc chain's form (`schedule.anchor_chain`: a 1x1 conv, its activation and the
    depthwise conv after it, one kernel, product CHAIN) at the target's threads and, where
    `schedule.one_thread_forms` asks, on one thread, last; () for any other group of several
    anchors. It has no NCHW form: lowering refuses two anchors (`_check_anchor`)."""
    chain = anchor_chain(graph, [n.id for n in nodes])
    if chain is None or any(not check(graph, nodes) for check in (_check_shapes, _check_connected_convex, _check_dtype)):
        return ()
    kernel = _chain_kernel(graph, nodes, chain, layout, max(1, host.threads))
    if not one_thread_forms([kernel.schedule], host):
        return (kernel,)
    serial = _chain_kernel(graph, nodes, chain, layout, 1)
    return kernel, replace(serial, schedule=replace(serial.schedule, split=ONE_THREAD))


def _chain_kernel(graph: Graph, nodes: list[Node], chain: Chain, layout: Layout, threads: int) -> Kernel:
    """The chain priced as it runs at `threads` threads (`schedule.ChainItems`): every op once,
    the input read once per group of channel blocks; the tensors between the anchors never in
    memory (no kernel input or output); every multiply-add at the packed product's rate."""
    expand, dw = chain.expand, chain.dw
    schedule = replace(PACKED, product=CHAIN, layout_in=layout, layout_out=layout)
    _, _, k = _gemm_dims(graph, expand)
    kernel = _build(graph, nodes, "conv", expand.id, graph.tensors[dw.outputs[0]].size, k, 4 + 2 * len(nodes),
                    schedule, host=True)
    tc = sum(node_flops(n.op_type, n.attrs, graph.node_inputs(n), graph.node_outputs(n))
             for n in nodes if n.kind == OpKind.ANCHOR)
    items = chain_items(graph, chain, layout.block)
    again = layout.nbytes(graph.tensors[expand.inputs[0]].shape, 4) * (items.groups(threads) - 1)
    kernel = replace(kernel, tc_flops=tc, scalar_flops=kernel.scalar_flops + kernel.tc_flops - tc,
                     read_bytes=kernel.read_bytes + again, imbalance=items.imbalance(threads))
    return _with_layouts(graph, kernel, expand)


def reorder(graph: Graph, tensor: str, source: Layout, target: Layout, split: str = "") -> Kernel:
    """The kernel that copies a 4-D `tensor` from layout `source` to `target` (NCHW <-> NCHWc on a
    CPU, `codegen.cpu_conv_nchwc.reorder_kernel`; NCHW <-> NHWC on a GPU, `codegen.nhwc`, its
    launch `schedule.reorder_grid`), priced as the pointwise copy it is: each
    side's bytes as it lies (a blocked side with its padding), no arithmetic. What a plan pays on
    an edge whose producer writes one layout and consumer reads the other. `split` ONE_THREAD:
    its one-thread form (`reorder_choices`)."""
    info = graph.tensors[tensor]
    itemsize = info.nbytes // max(1, info.size)
    if source.channels_last or target.channels_last:  # a GPU's: squares transposed in shared memory
        schedule = Schedule("generated", "grid-stride", "cuda-core", grid=reorder_grid(info.shape),
                            smem_bytes=REORDER_SQUARE * (REORDER_SQUARE + 1) * itemsize, layout_in=source,
                            layout_out=target)
    else:
        schedule = Schedule("generated", "grid-stride", "cpu-simd", threads=1, layout_in=source, layout_out=target,
                            split=split)
    return Kernel("pointwise", (), (), None, info.dtype, (tensor,), (tensor,), max(source.size(info.shape),
                  target.size(info.shape)), 0, 2, 0, 0, 0, source.nbytes(info.shape, itemsize),
                  target.nbytes(info.shape, itemsize), schedule)


def reorder_choices(graph: Graph, tensor: str, source: Layout, target: Layout, host: CpuTarget) -> tuple[Kernel, ...]:
    """The reorder of `tensor` (`reorder`) and, above one thread, its one-thread form, last
    (`with_one_thread_forms`): a small tensor's copy costs less than a parallel region's fork."""
    return with_one_thread_forms((reorder(graph, tensor, source, target),), host)


def kernel_layouts(graph: Graph, kernel: Kernel, tensors: Iterable[str]) -> dict[str, Layout]:
    """How `kernel` reads or writes each of `tensors` (`schedule.tensor_layouts` under its schedule;
    an alias, a library call and every NCHW form: as in the model)."""
    anchor = graph.nodes[kernel.anchor] if kernel.anchor is not None else None
    return tensor_layouts(graph, anchor, list(tensors), kernel.schedule)


def reorders(graph: Graph, kernels: Sequence[Kernel]) -> list[tuple[str, Layout, Layout]]:
    """The copies a plan whose groups run as `kernels` (in order) makes: (tensor, from, to) for each
    tensor a kernel reads in another layout than its producer writes it (a graph input or a weight:
    as in the model), and each output of the graph written blocked (the model's outputs are NCHW);
    each (tensor, to) once, in order of first need. The one rule the search prices, plans record
    and programs run."""
    written = {t: lt for k in kernels for t, lt in kernel_layouts(graph, k, k.outputs).items()}
    needed: dict[tuple[str, Layout], Layout] = {}
    for k in kernels:
        for t, lt in kernel_layouts(graph, k, k.inputs).items():
            if lt != written.get(t, NCHW):
                needed.setdefault((t, lt), written.get(t, NCHW))
    for t in graph.outputs:
        if written.get(t, NCHW) != NCHW:
            needed.setdefault((t, NCHW), written[t])
    return [(t, source, target) for (t, target), source in needed.items()]


def _with_layouts(graph: Graph, kernel: Kernel, anchor: Node | None) -> Kernel:
    """`kernel` priced as it runs in its layouts (`schedule.tensor_layouts`): a blocked tensor's
    padded channels are read and written too, and a blocked conv computes whole output blocks (a
    block is one vector register): its product's multiply-adds and its packed filter's reads on
    the padded output channels too (24 channels in blocks of 16: 32). No multiply-adds on the
    padded input channels (a dense tile skips them, `cpu_conv_nchwc._Geometry._lanes`), though
    their blocks' bytes are read (whole cache lines)."""
    def padding(tensors) -> int:
        layouts = tensor_layouts(graph, anchor, tensors, kernel.schedule)
        return sum(layouts[t].size(graph.tensors[t].shape) * graph.tensors[t].nbytes // graph.tensors[t].size - graph.tensors[t].nbytes
                   for t in tensors if layouts[t].blocked)
    flops = filters = 0
    if anchor is not None and kernel.schedule.layout_out.blocked:
        (n, c, *pixels), w = graph.tensors[anchor.outputs[0]].shape, anchor.inputs[1]
        pad = kernel.schedule.layout_out.channels(c) - c
        flops = 2 * n * pad * math.prod(pixels) * math.prod(graph.tensors[w].shape[1:])
        filters = graph.tensors[w].nbytes * pad // c if w in kernel.inputs else 0
    return replace(kernel, tc_flops=kernel.tc_flops + flops, read_bytes=kernel.read_bytes + padding(kernel.inputs) + filters,
                   write_bytes=kernel.write_bytes + padding(kernel.outputs))


def nhwc_choices(graph: Graph, group: FusionGroup, tuned: Sequence[tuple[str, str, tuple[int, ...]]] = ()
                 ) -> tuple[Kernel, ...]:
    """The group's channels-last forms on a GPU (`layout.NHWC`): a conv group `schedule.nhwc_conv`
    accepts, at each mma.sync configuration (`_tensor_core_choices` with its input and outputs
    NHWC: K = (r, s, c), A staged in 16-byte chunks of channels), priced with the sectors its A
    staging moves as the input lies (`schedule.activation_sectors`); () for any other group or a
    group lowering refuses. Kept apart from `choices` as `nchwc_choices` is: a plan's programs
    feed every kernel NCHW unless the plan chose otherwise."""
    nodes = [graph.nodes[i] for i in sorted(group.nodes)]
    anchors = [n for n in nodes if n.kind == OpKind.ANCHOR]
    if (len(anchors) != 1 or not nhwc_conv(graph, group.nodes, anchors[0])
            or isinstance(_lower_checked(graph, nodes), FusionDecision)):  # the cheap checks first
        return ()
    anchor = anchors[0]
    return _tensor_core_choices(graph, nodes, anchor, anchor_template(graph, anchor), tuple(tuned), NHWC)


def _tensor_core_choices(graph: Graph, nodes: list[Node], anchor: Node, template: str,
                         tuned: tuple = (), layout: Layout = NCHW) -> tuple[Kernel, ...]:
    """The anchor group on tensor cores, one Kernel per tile of `mma_tiles` (wmma) and then one per
    configuration of `mma_sync_tiles` (mma.sync) whose grid fits, where its operands have a
    tensor-core skeleton and a tile applies (`has_gemm_view`, `anchor_derived`); where the tuned
    table has a skeleton's configuration for the shape class (`schedule.tuned_choice`), that one
    alone (split-K still a choice beside it). `layout` NHWC (`nhwc_choices`): the mma.sync
    configurations alone, reading and writing channels last. A conv's activation is priced at the
    sectors its staging moves (`_with_sectors`)."""
    skeleton = tensor_core_skeleton(graph, anchor)
    if not skeleton or not has_gemm_view(graph, anchor) or anchor_derived(graph, [n.id for n in nodes], anchor) is None:
        return ()
    m, n_dim, k = _gemm_dims(graph, anchor)
    z, m_z = _tile_batches(graph, anchor)  # the grid: tiles of each batch (MatMul) or group (Conv)
    out_size = graph.tensors[anchor.outputs[0]].size
    stages = 2 if set(anchor.inputs[:2]) & set(external_inputs(graph, nodes)) else 1  # double-buffered when
    kernels = []  # an operand is a plain copy of an input
    wmma_tuned = tuned_choice(tuned, skeleton, m_z, n_dim)
    sync_tuned = tuned_choice(tuned, MMA_SYNC_SKELETONS[skeleton], m_z, n_dim)
    for tm, tn, tk in mma_tiles(m, n_dim):
        if (wmma_tuned and (tm, tn) != wmma_tuned) or layout.channels_last:
            continue
        grid = (math.ceil(n_dim / tn), math.ceil(m_z / tm), z)
        if max(grid[1:]) <= MAX_GRID_YZ:
            live = tm * tn // MMA_THREADS + (tm + tn) // 8 + 2 * (len(nodes) - 1)  # accumulator, operand fragments
            kernels.append(_build(graph, nodes, template, anchor.id, out_size, k, live,
                                  mma(skeleton, (tm, tn, tk), stages, grid)))
    for config in mma_sync_tiles(m, n_dim):
        if sync_tuned and tuple(config) != sync_tuned:
            continue
        _, _, wm, wn, _ = config
        split = mma_sync_split(m_z, n_dim, k, mma_sync(MMA_SYNC_SKELETONS[skeleton], config, m_z, n_dim, z).tile, z)
        for ways in split_choices(split):  # split where the output has few tiles, down to unsplit
            schedule = replace(mma_sync(MMA_SYNC_SKELETONS[skeleton], config, m_z, n_dim, z, ways),
                               layout_in=layout, layout_out=layout)
            if max(schedule.grid[1:]) > MAX_GRID_YZ:
                continue
            # a lane's accumulators, its A and B fragments, addressing
            live = wm * wn // 32 + 4 * (wm // 16) + 2 * (wn // 8) + 16 + 2 * (len(nodes) - 1)
            kernels.append(_with_workspace(_build(graph, nodes, template, anchor.id, out_size, k, live, schedule)))
    return tuple(_with_staging(graph, kernel, anchor) for kernel in kernels)


def _with_staging(graph: Graph, kernel: Kernel, anchor: Node) -> Kernel:
    """A generated tiled conv (tensor or CUDA cores) priced at what its A staging moves as the
    input lies: its activation's bytes as the 32-byte sectors the loads touch
    (`schedule.activation_sectors`: NCHW's strided or short rows of pixels, NHWC's runs of
    channels), and the loads it issues (`Kernel.staged_loads`, charged
    `RooflineParams.staging_load_flops` each), the A tile staged once per column of tiles
    (`schedule.a_load_elements`: an element per load, or 16 bytes of channels channels last); a
    GEMM as it is."""
    if anchor.op_type != "Conv" or len(graph.tensors[anchor.inputs[0]].shape or ()) != 4:
        return kernel
    x = graph.tensors[anchor.inputs[0]]
    itemsize, layout = x.nbytes // max(1, x.size), kernel.schedule.layout_in
    staged = MMA_ELEMENT_BYTES.get(kernel.schedule.skeleton, itemsize)  # the element the tile holds
    m, n_dim, k = _gemm_dims(graph, anchor)
    z, _ = _tile_batches(graph, anchor)
    loads = z * m * k * math.ceil(n_dim / kernel.schedule.tile[1]) // a_load_elements(graph, anchor, layout, staged)
    extra = round(x.nbytes * (activation_sectors(graph, anchor, layout, itemsize) - 1))
    return replace(kernel, read_bytes=kernel.read_bytes + extra, staged_loads=loads)


def _cuda_core_choices(graph: Graph, nodes: list[Node], anchor: Node, template: str) -> tuple[Kernel, ...]:
    """The anchor group on CUDA cores: `tiled`, one Kernel per tile of `gemm_tiles` with a thread
    layout and a grid that fits, where a tile applies; else `direct` (an epilogue that moves
    elements, ConvTranspose, 1-D operands): a thread per output element with its dot product
    inline, no tile, each operand element re-read (and its prologue recomputed) once per output
    that uses it."""
    m, n_dim, k = _gemm_dims(graph, anchor)
    z, m_z = _tile_batches(graph, anchor)
    out_size = graph.tensors[anchor.outputs[0]].size
    kernels = []
    if has_gemm_view(graph, anchor) and anchor_derived(graph, [n.id for n in nodes], anchor) is not None:
        for tm, tn, tk in gemm_tiles(m, n_dim):
            grid = (math.ceil(n_dim / tn), math.ceil(m_z / tm), z)
            if max(grid[1:]) > MAX_GRID_YZ or thread_layout(tm, tn) is None:
                continue
            live = tm * tn // THREADS + (tm + tn) // 16 + 2 * (len(nodes) - 1)
            own = Schedule("generated", "tiled", "cuda-core", (tm, tn, tk), threads=min(THREADS, tm * tn), grid=grid,
                           smem_bytes=(tm * tk + tk * tn) * 4)  # A and B staged once per K step, as float
            kernels.append(_with_staging(graph, _build(graph, nodes, template, anchor.id, out_size, k, live, own),
                                         anchor))
    if kernels:
        return tuple(kernels)
    own = replace(grid_stride(max(graph.tensors[t].size for t in _external_outputs(graph, nodes))), skeleton="direct")
    return (_build(graph, nodes, template, anchor.id, out_size, k, 4 + 2 * len(nodes), own, reload_tile=(1, 1, k)),)


def _library_anchor(graph: Graph, nodes: list[Node], anchor: Node, m: int, n_dim: int, k: int,
                    tile: tuple[int, int, int], library: str = "", split: int = 1) -> Kernel:
    """A lone anchor as the library's call (`library`: a 2-D conv's is cuDNN's; a conv group with
    its bias and activation, cuDNN's one fused graph, whose epilogue runs on its accumulators) at
    `tile` (its heuristic's: `schedule.library_tiles`), K split `split` ways (`schedule.split_k`
    where the output has few tiles: cuBLAS splits skinny GEMMs), paying the fp32 partial sums'
    round trip at the output's real M x N (`split_k_workspace`: we assume cuBLAS's split-K, in
    the kernel or through its reduction kernel, keeps a partial of each real output element per
    split, not of whole padded tiles); its grid the whole tiles it launches."""
    tm, tn, tk = tile
    out_size = graph.tensors[anchor.outputs[0]].size
    _, m_z = _tile_batches(graph, anchor)
    z = max(1, out_size // max(1, m_z * n_dim))  # MatMul batches, conv groups
    schedule = Schedule("library", "library", "tensor-core", (tm, tn, tk), split_k=split, threads=min(THREADS, tm * tn),
                        grid=(math.ceil(n_dim / tn), math.ceil(m_z / tm), z * split),  # whole tiles, as launched
                        smem_bytes=(tm * tk + tk * tn) * 4, library=library,
                        workspace_bytes=split_k_workspace(split, out_size))
    live = tm * tn // THREADS + (tm + tn) // 16
    return _with_workspace(_build(graph, nodes, anchor_template(graph, anchor), anchor.id, out_size * split, k, live,
                                  schedule))


def _with_workspace(kernel: Kernel) -> Kernel:
    """`kernel` with its split-K partial sums' round trip in its traffic: the schedule's
    `workspace_bytes` written by the splits, then read back once by the reduction (the generator
    declares the same bytes)."""
    extra = kernel.schedule.workspace_bytes
    return replace(kernel, read_bytes=kernel.read_bytes + extra, write_bytes=kernel.write_bytes + extra)


def conv_routed(graph: Graph, options: tuple[Kernel, ...], cudnn: bool) -> tuple[Kernel, ...]:
    """A GPU group's choices as the conv route runs them (`backends.cudnn.conv_route`): as they
    are where a cuDNN route is installed; else a lone conv's cuDNN call is the named fallback,
    im2col + cuBLAS through CuPy, paying its panel's round trip (the k x k-unfolded input written,
    then read by the GEMM), and the fused cuDNN graph is no choice."""
    if cudnn:
        return options
    routed = []
    for kernel in options:
        if kernel.schedule.library == "cudnn-fused":
            continue
        if kernel.schedule.library == "cudnn":
            m, _, k = _gemm_dims(graph, graph.nodes[kernel.anchor])
            groups, _ = _tile_batches(graph, graph.nodes[kernel.anchor])
            panel = m * k * groups * DTYPE_BYTES[kernel.dtype]
            kernel = replace(kernel, schedule=replace(kernel.schedule, library="im2col"),
                             read_bytes=kernel.read_bytes + panel, write_bytes=kernel.write_bytes + panel)
        routed.append(kernel)
    return tuple(routed)


def anchor_template(graph: Graph, anchor: Node) -> str:
    """An anchor's template: "depthwise" (`depthwise_conv`), "conv_disjoint" (`disjoint_windows`),
    else "conv" or "gemm" by its op."""
    if depthwise_conv(graph, anchor):
        return "depthwise"
    return "conv_disjoint" if disjoint_windows(graph, anchor) else GEMM_TEMPLATE[anchor.op_type]


def _row_epilogue(graph: Graph, n: Node, anchor: Node) -> int | FusionDecision:
    """Row length of a Softmax epilogue over the anchor output's last axis, else a refusal."""
    if n.op_type not in ROW_EPILOGUE_OPS:
        return FusionDecision.refuse(f"{_label(n)} cannot join the epilogue of {_label(anchor)}")
    if not graph.reaches(anchor.id, n.id):
        return FusionDecision.refuse(f"{_label(n)} is not after {_label(anchor)}")
    rows = reduced_rows(graph, n)
    if isinstance(rows, FusionDecision):
        return rows
    _, row_len = rows
    if row_len != graph.tensors[n.inputs[0]].shape[-1]:
        return FusionDecision.refuse(f"{_label(n)} does not reduce the last axis only")
    if row_len > MAX_ROW_TILE:
        return FusionDecision.refuse(f"{_label(n)} row of {row_len} > {MAX_ROW_TILE}: no single tile holds it")
    return row_len


# -- numbers ----------------------------------------------------------------------------------

def external_inputs(graph: Graph, nodes: Iterable[Node]) -> list[str]:
    nodes = list(nodes)
    produced = {t for n in nodes for t in n.outputs}
    seen: dict[str, None] = {}
    for n in nodes:
        for t in n.inputs:
            if t and t not in produced:
                seen.setdefault(t)
    return list(seen)


def _external_outputs(graph: Graph, nodes: list[Node]) -> list[str]:
    ids = {n.id for n in nodes}
    outs = []
    for n in nodes:
        for t in n.outputs:
            if t and (graph.is_output(t) or any(c not in ids for c in graph.consumers(t))):
                outs.append(t)
    return outs


def _build(graph: Graph, nodes: list[Node], template: str, anchor: int | None, iteration: int,
           reduction: int, live: int, schedule: Schedule, *, reload_tile: tuple[int, ...] | None = None,
           host: bool = False) -> Kernel:
    inputs = external_inputs(graph, nodes)
    outputs = _external_outputs(graph, nodes)
    alias = schedule.impl == "alias"
    reloads = _prologue_reloads(graph, nodes, anchor, schedule.tile if reload_tile is None else reload_tile,
                                band=host and anchor is not None and (conv_reads_band(graph, graph.nodes[anchor])
                                                                      or schedule.skeleton == "depthwise"))
    per_tap = _window_recompute(graph, nodes)
    if host and anchor is not None:  # the C skeleton materializes the product: a pool after it
        # recomputes the epilogue per tap, never the anchor or its prologue
        per_tap = {i: f for i, f in per_tap.items() if i != anchor and not graph.reaches(i, anchor)}
    members = {n.id for n in nodes}
    fold = folded_scale(graph, members, graph.nodes[anchor]) if host and anchor is not None else None
    scaled = scaled_product(graph, members, graph.nodes[anchor], schedule.product) if anchor is not None else None
    folded = (fold[2] if fold else frozenset()) | (scaled.nodes if scaled else frozenset())
    silent = {i for c in gelu_chains(graph, members).values() for i in (c.scale, c.add)}
    tc = scalar = trans = divisions = 0
    for n in nodes:
        if n.id in folded:  # a scale the C product takes as its alpha or packs into B: no op runs
            continue
        if n.id in silent:  # a GELU's scale and + 1, folded into its one call: no op runs
            continue
        times = reloads.get(n.id, 1) * per_tap.get(n.id, 1.0)
        flops = node_flops(n.op_type, n.attrs, graph.node_inputs(n), graph.node_outputs(n))
        trans += round(times * node_transcendentals(n.op_type, n.attrs, graph.node_inputs(n), graph.node_outputs(n)))
        if n.id == anchor and n.id not in per_tap:
            tc += flops
        else:  # an anchor under a pool is recomputed per tap by a thread per output: no tensor cores
            scalar += round(times * flops)
            if n.op_type in DIVIDE_OPS:
                divisions += round(times * graph.tensors[n.outputs[0]].size)
    read = 0 if alias else sum(_read_bytes(graph, nodes, t) for t in inputs)
    write = 0 if alias else sum(graph.tensors[t].nbytes for t in outputs)
    dtype = _group_dtype(graph, nodes, anchor)
    return Kernel(template, tuple(n.id for n in nodes), tuple(n.op_type for n in nodes), anchor, dtype,
                  tuple(inputs), tuple(outputs), max(iteration, 1), reduction, max(live, 1),
                  tc, scalar, trans, read, write, schedule,
                  index_divisions=_index_divisions(graph, outputs + _reduced_inputs(nodes)),
                  divisions=divisions)


DIVIDE_OPS = frozenset({"Div", "Sqrt", "Reciprocal"})


def _reduced_inputs(nodes: list[Node]) -> list[str]:
    """The tensors a row-wise kernel walks element by element: its reductions' inputs."""
    return [n.inputs[0] for n in nodes if n.kind == OpKind.REDUCE and n.inputs and n.inputs[0]]


def _index_divisions(graph: Graph, tensors: list[str]) -> int:
    """Per element, the divisions and modulos by a non-power-of-two constant that unflatten a flat
    index into the multi-index of the largest tensor the kernel walks (its outputs; a row-wise
    kernel's reduced inputs): `i / stride % extent` per non-unit dim, where a power of two
    compiles to a shift or a mask."""
    shapes = [graph.tensors[t].shape for t in tensors if graph.tensors[t].shape is not None]
    if not shapes:
        return 0
    extents = [d for d in max(shapes, key=math.prod) if d > 1]
    count, stride = 0, 1
    for extent in reversed(extents):
        count += (stride > 1 and stride & (stride - 1) != 0) + (extent & (extent - 1) != 0)
        stride *= extent
    return count


def _prologue_reloads(graph: Graph, nodes: list[Node], anchor: int | None,
                      tile: tuple[int, ...], band: bool = False) -> dict[int, int]:
    """How many times a tiled kernel recomputes each prologue op: an element of the activation
    operand is loaded once per output tile along N (and, for a convolution, once per filter tap
    that reads it, unless the C conv computes its input once into a band: `conv_reads_band`);
    of the weight operand, once per tile along M."""
    if anchor is None or len(tile) < 2:
        return {}
    a = graph.nodes[anchor]
    m, n_dim, _ = _gemm_dims(graph, a)
    tm, tn = tile[0], tile[1]
    taps = math.prod(graph.tensors[a.inputs[1]].shape[2:]) if a.op_type in ("Conv", "ConvTranspose") and not band else 1
    per_operand = [math.ceil(n_dim / tn) * taps, math.ceil(m / tm)]
    reloads = {}
    for n in nodes:
        if n.id == anchor or not graph.reaches(n.id, anchor):
            continue
        for k, operand in enumerate(a.inputs[:2]):
            p = graph.producer(operand)
            if p is not None and (p == n.id or graph.reaches(n.id, p)):
                reloads[n.id] = max(reloads.get(n.id, 1), per_operand[k])
    return reloads


def _window_recompute(graph: Graph, nodes: list[Node]) -> dict[int, float]:
    """How many times each op upstream of a pool in the group is evaluated per element: a pool
    reads its input inline at every window tap, so a producer in the group (an anchor included:
    Conv+Relu → MaxPool) is recomputed once per in-bounds tap that covers its element — the
    pool's exact reads over its input's size (9/4 for resnet's 3×3 stride-2 stem pool); through
    a chain, the factors multiply (the largest over a node's consumers in the group)."""
    ids = {n.id for n in nodes}
    if not any(n.op_type in POOL_OPS for n in nodes):
        return {}
    factor: dict[int, float] = {}
    for n in reversed(nodes):  # topological order: every consumer before its producers
        f = 1.0
        for t in n.outputs:
            for c in graph.consumers(t) if t else ():
                if c not in ids:
                    continue
                user = graph.nodes[c]
                ratio = 1.0
                if user.op_type in POOL_OPS:
                    window = _pool_window(graph, user)
                    size = graph.tensors[user.inputs[0]].size
                    ratio = window.reads / size if not isinstance(window, str) and size else 1.0
                f = max(f, factor.get(c, 1.0) * ratio)
        if f != 1.0:
            factor[n.id] = f
    return factor


def _read_bytes(graph: Graph, nodes: list[Node], tensor: str) -> int:
    """Bytes read of an external input: all of it, except a table only indexed by Gathers (an
    embedding lookup reads the gathered rows, not the table)."""
    full = graph.tensors[tensor].nbytes
    users = [n for n in nodes if tensor in n.inputs]
    if users and all(n.op_type == "Gather" and n.inputs[0] == tensor and tensor not in n.inputs[1:] for n in users):
        return min(full, sum(graph.tensors[n.outputs[0]].nbytes for n in users))
    return full


def _group_dtype(graph: Graph, nodes: list[Node], anchor: int | None) -> str:
    if anchor is not None:
        return graph.tensors[graph.nodes[anchor].outputs[0]].dtype
    floats = [graph.tensors[t].dtype for n in nodes for t in n.outputs
              if t and graph.tensors[t].dtype in FLOAT_DTYPES]
    halves = [d for d in floats if d in HALF_DTYPES]
    if halves:  # a half group with float32 statistics inside is a half kernel
        return halves[-1]
    if floats:
        return floats[-1]
    outs = [graph.tensors[t].dtype for n in nodes for t in n.outputs if t]
    return outs[-1] if outs else "float32"
