"""Line charts as standalone SVG for docs/ (no plotting library): panels side by side, each with its own y axis from
zero, x on a log2 scale (context lengths, batch sizes)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from xml.sax.saxutils import escape

WIDTH, HEIGHT, MARGIN = 420, 280, 56
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


@dataclass
class Panel:
    """One chart: series name -> y per x (None: not measured there)."""

    title: str
    y_label: str
    xs: list[int]
    series: dict[str, list[float | None]]


def _nice_top(value: float) -> float:
    """The smallest 1, 1.5, 2, 3, 4, 5, 6 or 8 x 10^k at or above value (the y axis' top)."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 1.5, 2, 3, 4, 5, 6, 8, 10) if m * power >= value)


def _panel(panel: Panel, left: int) -> list[str]:
    top = _nice_top(max((y for ys in panel.series.values() for y in ys if y is not None), default=1))
    lo, hi = math.log2(min(panel.xs)), math.log2(max(panel.xs))
    plot_w, plot_h = WIDTH - 2 * MARGIN, HEIGHT - 2 * MARGIN

    def x(v: int) -> float:
        return left + MARGIN + (math.log2(v) - lo) / ((hi - lo) or 1) * plot_w

    def y(v: float) -> float:
        return MARGIN + plot_h * (1 - v / top)

    out = [f'<text x="{left + WIDTH / 2}" y="24" text-anchor="middle" font-weight="bold">{escape(panel.title)}</text>',
           f'<line x1="{left + MARGIN}" y1="{MARGIN + plot_h}" x2="{left + MARGIN + plot_w}" y2="{MARGIN + plot_h}" '
           'stroke="black"/>',
           f'<line x1="{left + MARGIN}" y1="{MARGIN}" x2="{left + MARGIN}" y2="{MARGIN + plot_h}" stroke="black"/>',
           f'<text x="{left + 14}" y="{MARGIN + plot_h / 2}" text-anchor="middle" transform="rotate(-90 '
           f'{left + 14} {MARGIN + plot_h / 2})">{escape(panel.y_label)}</text>']
    for tick in (0, top / 2, top):
        out.append(f'<text x="{left + MARGIN - 6}" y="{y(tick) + 4}" text-anchor="end">{tick:g}</text>')
    for v in panel.xs:
        label = f"{v // 2 ** 20}M" if v >= 2 ** 20 else f"{v // 1024}K" if v >= 1024 else str(v)
        out.append(f'<text x="{x(v)}" y="{MARGIN + plot_h + 18}" text-anchor="middle">{label}</text>')
    for i, (name, ys) in enumerate(panel.series.items()):
        color = COLORS[i % len(COLORS)]
        points = [(x(v), y(w)) for v, w in zip(panel.xs, ys) if w is not None]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                   + " ".join(f"{px:.1f},{py:.1f}" for px, py in points) + '"/>')
        out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>' for px, py in points]
        out.append(f'<text x="{left + MARGIN + 8}" y="{MARGIN + 14 + 16 * i}" fill="{color}">{escape(name)}</text>')
    return out


def line_charts(panels: list[Panel]) -> str:
    """The panels side by side as one SVG document."""
    body = [line for i, panel in enumerate(panels) for line in _panel(panel, i * WIDTH)]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH * len(panels)}" height="{HEIGHT}" '
            'font-family="sans-serif" font-size="12">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")
