"""Pictures of each LN's zero-mean graph, what gets centered and where folding fails: an HTML page
with one inline SVG per LN, or one SVG with all of them stacked."""

from __future__ import annotations

import html
from pathlib import Path

from torch import nn

from .driver import Analysis
from .capture import ExampleInputs, capture
from ..errors import EnjoylnError

_COLOURS = {
    "ln": "#cfe2ff",
    "op": "#ffffff",
    "source": "#c7f0c2",
    "centerable": "#fff3bf",
    "zero": "#e6e6e6",
    "blocked": "#f8c4c4",
}
_W, _H, _GAP_X, _GAP_Y = 270, 34, 60, 14


def _layout(
    nodes: dict[str, dict], edges: list[tuple[str, str]], root: str
) -> dict[str, tuple[int, int]]:
    """Columns by distance from the LN (which sits on the right), rows in visit order."""
    users: dict[str, list[str]] = {}
    for src, dst in edges:
        users.setdefault(dst, []).append(src)
    depth = {root: 0}
    queue = [root]
    for n in queue:  # breadth first: the queue grows as it is read
        for src in users.get(n, []):
            if src not in depth:
                depth[src] = depth[n] + 1
                queue.append(src)
    cols: dict[int, list[str]] = {}
    for n in nodes:
        cols.setdefault(depth.get(n, 0), []).append(n)
    width = max(cols) if cols else 0
    return {
        n: ((width - d) * (_W + _GAP_X), i * (_H + _GAP_Y))
        for d, names in cols.items()
        for i, n in enumerate(names)
    }


def _svg(
    title: str,
    reason: str,
    foldable: bool,
    nodes: dict[str, dict],
    edges: list[tuple[str, str]],
    root: str,
) -> tuple[str, int, int]:
    pos = _layout(nodes, edges, root)
    w = max((x for x, _ in pos.values()), default=0) + _W + 20
    h = max((y for _, y in pos.values()), default=0) + _H + 50
    parts = [
        '<g transform="translate(10,0)">',
        f'<text x="0" y="16" font-weight="bold">{html.escape(title)}</text>',
    ]
    if reason:
        parts.append(f'<text x="0" y="32" fill="#a00">{html.escape(reason)}</text>')
    for src, dst in edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        parts.append(
            f'<line x1="{x1 + _W}" y1="{y1 + 40 + _H // 2}" x2="{x2}" y2="{y2 + 40 + _H // 2}" '
            'stroke="#888" marker-end="url(#arrow)"/>'
        )
    for name, info in nodes.items():
        x, y = pos[name]
        label = info["label"] if len(info["label"]) <= 40 else "…" + info["label"][-39:]
        tip = html.escape(f"{info['label']}\n{info['detail']}".strip())
        kind = "centerable" if info["kind"] == "source" and not foldable else info["kind"]
        parts.append(
            f'<g><title>{tip}</title><rect x="{x}" y="{y + 40}" width="{_W}" height="{_H}" rx="6" '
            f'fill="{_COLOURS[kind]}" stroke="#555"/>'
            f'<text x="{x + 8}" y="{y + 40 + 21}" font-size="12">{html.escape(label)}</text></g>'
        )
    parts.append("</g>")
    return "\n".join(parts), w + 20, h


_OPEN = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" '
    'font-size="13">'
    '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
    'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker></defs>'
)
_LEGEND = (
    "green: centered by CBWC &middot; yellow: centerable, but this LN does not fold &middot; red: "
    "where "
    "folding fails &middot; white: carries the zero mean &middot; grey: zero-mean already &middot; "
    "blue: the LN"
)


def write_graph(model: nn.Module, path: str | Path, example_inputs: ExampleInputs = None) -> Path:
    """Write every LN's zero-mean graph to ``path`` (.html or .svg).

    >>> write_graph(model, "graphs.html")  # doctest: +SKIP
    """
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm", ".svg"):
        raise EnjoylnError(f"--graph must end in .html or .svg, not {path.suffix or 'nothing'}")
    analysis = Analysis(capture(model, example_inputs))
    plan = analysis.run()
    blocks: list[tuple[str, int, int]] = []
    for name, calls in analysis.ln_nodes().items():
        e = plan[name]
        nodes, edges = analysis.zero_mean_graph(calls[0])
        status = "folds" if e.foldable else "kept as LayerNorm"
        blocks.append(_svg(f"{name}: {status}", e.reason, e.foldable, nodes, edges, calls[0].name))
    width = max((b[1] for b in blocks), default=400)
    if path.suffix.lower() == ".svg":  # one picture: stack the blocks
        body, dy = [], 0
        for svg, _, h in blocks:
            body.append(f'<g transform="translate(0,{dy})">{svg}</g>')
            dy += h + 20
        text = _OPEN.format(width, max(dy, 40)) + "".join(body) + "</svg>\n"
    else:
        sections = [f"<section>{_OPEN.format(w, h)}{svg}</svg></section>" for svg, w, h in blocks]
        text = (
            "<!doctype html><html><head><meta charset='utf-8'><title>enjoyln: "
            f"{html.escape(plan.model)}</title><style>body{{font-family:sans-serif}} "
            f"section{{overflow-x:auto;"
            "margin-bottom:1em}</style></head><body>"
            f"<h1>{html.escape(plan.summary().splitlines()[0])}</h1><p>{_LEGEND}</p>"
            + "\n".join(sections)
            + "</body></html>\n"
        )
    try:
        path.write_text(text)
    except OSError as exc:
        raise EnjoylnError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path
