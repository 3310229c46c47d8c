"""Plan pictures: the graph with each group as one box (SVG, and an offline HTML page).

Problem: a reader must see at a glance what was fused, what each kernel is (template), what
bounds it (memory, compute, launch) and where the time goes — for graphs of 200 to 900 nodes.
Approach: draw the quotient graph (one box per group) top to bottom. Layout: Graphviz `dot` when
it is installed, else our own layered layout — layer = longest path from a source, order inside
a layer by the barycenter of the predecessors (two sweeps), boxes centred per layer. A box is
coloured by template, carries a badge for its bound (M, C, L), its id, predicted time and ops;
its tooltip lists every node. Edges are Bézier curves with arrowheads. The HTML page inlines the
SVG with a legend, a zoom control and a table of groups: no network, no CDN.
Invariants: output is deterministic text; every group's id (g<id>) appears in the picture.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Sequence

from fusesearch.plans import Plan

COLORS = {"pointwise": "#8ecae6", "rowwise": "#ffd166", "gemm": "#f4a261", "conv": "#e76f51", "conv_disjoint": "#f28482",
          "depthwise": "#d4a5a5", "opaque": "#adb5bd", "alias": "#e9ecef"}
BOUND_BADGE = {"memory": "M", "compute": "C", "launch": "L"}
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 190, 46, 30, 38, 20
LEGEND_STEP = 95  # px per template key of the legend
BOUND_KEY = "bound: M memory · C compute · L launch"
CHAR_W = 6.6  # px: the widest average glyph of an 11 px sans-serif (0.6 em), so text never runs past
LEGEND_W = len(COLORS) * LEGEND_STEP + len(BOUND_KEY) * CHAR_W
MAX_OPS_CHARS = 30


def _template(plan: Plan, g) -> str:
    return "alias" if g.kernel.alias else g.kernel.template


def _ops(plan: Plan, g) -> list[str]:
    return [plan.graph.nodes[i].op_type for i in g.nodes]


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def _short(text: str, limit: int = MAX_OPS_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def quotient_edges(plan: Plan) -> list[tuple[int, int]]:
    owner = {v: g.id for g in plan.groups for v in g.nodes}
    return sorted({(owner[u], owner[w]) for u in owner for w in plan.graph.successors(u) if owner[u] != owner[w]})


# -- layout -----------------------------------------------------------------------------------

def layered_layout(n: int, edges: Sequence[tuple[int, int]]) -> dict[int, tuple[float, float]]:
    """Centre (x, y) of each of n boxes; ids are in topological order (plan order)."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        preds[b].append(a)
    layer = [0] * n
    for v in range(n):
        layer[v] = 1 + max((layer[p] for p in preds[v]), default=-1)
    rows: dict[int, list[int]] = {}
    for v in range(n):
        rows.setdefault(layer[v], []).append(v)
    position = {v: float(i) for r in rows.values() for i, v in enumerate(r)}
    for _ in range(2):
        for r in sorted(rows):
            members = rows[r]
            bary = {v: (sum(position[p] for p in preds[v]) / len(preds[v]) if preds[v] else position[v])
                    for v in members}
            members.sort(key=lambda v: (bary[v], v))
            for i, v in enumerate(members):
                position[v] = float(i)
    width = max((len(r) for r in rows.values()), default=1)
    coords = {}
    for r, members in rows.items():
        offset = (width - len(members)) / 2
        for i, v in enumerate(members):
            coords[v] = (MARGIN + (offset + i) * (BOX_W + GAP_X) + BOX_W / 2, MARGIN + r * (BOX_H + GAP_Y) + BOX_H / 2)
    return coords


# -- SVG --------------------------------------------------------------------------------------

def plan_svg(plan: Plan, engine: str = "auto") -> str:
    """The picture as SVG text; engine 'dot' (Graphviz), 'python' or 'auto' (dot if installed)."""
    if engine == "dot" or (engine == "auto" and shutil.which("dot")):
        svg = _dot_svg(plan)
        if svg is not None:
            return svg
    return _python_svg(plan)


def _title(plan: Plan, g) -> str:
    nodes = [f"{plan.graph.nodes[i].name} ({plan.graph.nodes[i].op_type})" for i in g.nodes]
    c = g.cost
    return (f"g{g.id}: {_template(plan, g)}, {_time(c.time_s)}, {c.bound}-bound, occupancy {c.occupancy:.2f}, "
            f"{c.dram_bytes / 1e6:.2f} MB, {c.flops / 1e6:.1f} MFLOP\n" + "\n".join(nodes))


def _python_svg(plan: Plan) -> str:
    edges = quotient_edges(plan)
    coords = layered_layout(len(plan.groups), edges)
    width = max(max((x for x, _ in coords.values()), default=0) + BOX_W / 2, MARGIN + LEGEND_W) + MARGIN
    height = max((y for _, y in coords.values()), default=0) + BOX_H / 2 + MARGIN + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
             f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
             'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>',
             f'<title>{html.escape(_caption(plan))}</title>', '<g id="edges">']
    for a, b in edges:
        (x1, y1), (x2, y2) = coords[a], coords[b]
        y1, y2 = y1 + BOX_H / 2, y2 - BOX_H / 2
        mid = (y1 + y2) / 2
        parts.append(f'<path d="M {x1:.1f} {y1:.1f} C {x1:.1f} {mid:.1f}, {x2:.1f} {mid:.1f}, {x2:.1f} {y2:.1f}" '
                     'fill="none" stroke="#777" stroke-width="1" marker-end="url(#arrow)"/>')
    parts.append('</g><g id="groups">')
    for g in plan.groups:
        parts.append(_box(plan, g, *coords[g.id]))
    parts.append("</g>")
    parts.append(_legend(MARGIN, height - 30))
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _box(plan: Plan, g, cx: float, cy: float) -> str:
    template = _template(plan, g)
    x, y = cx - BOX_W / 2, cy - BOX_H / 2
    ops = _short("+".join(_ops(plan, g)))
    badge = BOUND_BADGE.get(g.cost.bound, "?")
    return (f'<g id="g{g.id}" class="group {template}"><title>{html.escape(_title(plan, g))}</title>'
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{COLORS[template]}" '
            f'stroke="#333" stroke-width="{2 if len(g.nodes) > 1 else 1}"/>'
            f'<text x="{x + 8:.1f}" y="{y + 17:.1f}" font-weight="bold">g{g.id} · {template} · '
            f'{html.escape(_time(g.cost.time_s))}</text>'
            f'<text x="{x + 8:.1f}" y="{y + 35:.1f}">{html.escape(ops)}</text>'
            f'<circle cx="{x + BOX_W - 12:.1f}" cy="{y + 12:.1f}" r="8" fill="#fff" stroke="#333"/>'
            f'<text x="{x + BOX_W - 12:.1f}" y="{y + 16:.1f}" text-anchor="middle" font-size="10">{badge}</text></g>')


def _legend(x: float, y: float) -> str:
    items = []
    for i, (name, color) in enumerate(COLORS.items()):
        items.append(f'<rect x="{x + i * LEGEND_STEP:.0f}" y="{y:.0f}" width="14" height="14" fill="{color}" '
                     f'stroke="#333"/><text x="{x + i * LEGEND_STEP + 18:.0f}" y="{y + 11:.0f}">{name}</text>')
    items.append(f'<text x="{x + len(COLORS) * LEGEND_STEP:.0f}" y="{y + 11:.0f}">{BOUND_KEY}</text>')
    return '<g id="legend">' + "".join(items) + "</g>"


def _caption(plan: Plan) -> str:
    return (f"{plan.model.name} on {plan.device}, {plan.strategy}: {plan.kernels} kernels, "
            f"{_time(plan.time_s)} predicted ({plan.speedup:.2f}x over unfused)")


def _dot_svg(plan: Plan) -> str | None:
    lines = ["digraph plan {", "rankdir=TB; node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=10];"]
    for g in plan.groups:
        template = _template(plan, g)
        label = f"g{g.id} · {template} · {_time(g.cost.time_s)} [{BOUND_BADGE.get(g.cost.bound, '?')}]\\n" + _short(
            "+".join(_ops(plan, g)))
        tooltip = _title(plan, g).replace('"', "'").replace("\n", "&#10;")
        lines.append(f'g{g.id} [id="g{g.id}", label="{label}", fillcolor="{COLORS[template]}", tooltip="{tooltip}"];')
    for a, b in quotient_edges(plan):
        lines.append(f"g{a} -> g{b};")
    lines.append("}")
    try:
        done = subprocess.run(["dot", "-Tsvg"], input="\n".join(lines), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 and "<svg" in done.stdout else None


# -- HTML -------------------------------------------------------------------------------------

_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 16px; color: #222; }}
#view {{ border: 1px solid #ccc; overflow: auto; max-height: 75vh; }}
#canvas {{ transform-origin: 0 0; }}
table {{ border-collapse: collapse; margin-top: 16px; font-size: 13px; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; }}
th {{ background: #f3f3f3; }} td.num {{ text-align: right; }}
.group:hover rect {{ stroke-width: 3; }}
</style></head>
<body>
<h2>{title}</h2>
<p>{summary}</p>
<p>Zoom: <button onclick="zoom(1.25)">+</button> <button onclick="zoom(0.8)">&minus;</button>
<button onclick="setZoom(1)">1:1</button> · hover a box for its nodes</p>
<div id="view"><div id="canvas">
{svg}
</div></div>
<table><thead><tr><th>group</th><th>template</th><th>bound</th><th>time</th><th>occupancy</th><th>ops</th>
<th>nodes</th></tr></thead><tbody>
{rows}
</tbody></table>
<script>
let scale = 1;
function setZoom(s) {{ scale = s; document.getElementById('canvas').style.transform = 'scale(' + s + ')'; }}
function zoom(f) {{ setZoom(Math.min(4, Math.max(0.1, scale * f))); }}
</script>
</body></html>
"""


def plan_html(plan: Plan, engine: str = "auto") -> str:
    svg = plan_svg(plan, engine)
    svg = svg[svg.index("<svg"):]  # drop an XML prolog (dot writes one)
    rows = []
    for g in plan.groups:
        nodes = ", ".join(plan.graph.nodes[i].name for i in g.nodes)
        rows.append(f'<tr id="row-g{g.id}"><td>g{g.id}</td><td>{_template(plan, g)}</td><td>{g.cost.bound}</td>'
                    f'<td class="num">{html.escape(_time(g.cost.time_s))}</td><td class="num">{g.cost.occupancy:.2f}</td>'
                    f'<td>{html.escape("+".join(_ops(plan, g)))}</td><td>{html.escape(nodes)}</td></tr>')
    summary = html.escape(_caption(plan) + f"; lower bound {_time(plan.lower_bound_s)}; solver {plan.solver.status}")
    return _HTML.format(title=html.escape(f"fusesearch plan: {plan.model.name} on {plan.device}"),
                        summary=summary, svg=svg, rows="\n".join(rows))
