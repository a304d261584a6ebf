"""benchmarks/plot.py: the SVG parses; each series is one polyline through its measured points only, x on a log2
scale across the panel (equal ratios, equal steps), y from zero at the axis to the top tick, which is at or above the
largest value."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from benchmarks.plot import HEIGHT, MARGIN, WIDTH, Panel, line_charts

SVG = "{http://www.w3.org/2000/svg}"


def points(polyline: ET.Element) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in polyline.get("points").split()]


def test_series_are_drawn_on_a_log2_x_axis_from_zero():
    panels = [Panel("a", "ms", [1024, 2048, 8192], {"one": [3.0, None, 12.0], "two": [0.0, 6.0, 9.0]}),
              Panel("b", "MiB", [1, 4], {"three": [5.0, 70.0]})]
    root = ET.fromstring(line_charts(panels))
    assert root.get("width") == str(2 * WIDTH)
    one, two, three = (points(p) for p in root.iter(f"{SVG}polyline"))
    assert len(one) == 2 and len(two) == 3 and len(three) == 2              # None is not drawn
    (x0, y0), (x1, y1), (x2, y2) = two
    assert x0 == MARGIN and x2 == WIDTH - MARGIN and abs(x1 - (x0 + (x2 - x0) / 3)) < 0.1    # log2: 1K, 2K, 8K
    bottom = HEIGHT - MARGIN
    assert y0 == bottom and 0 < bottom - y2 < bottom - MARGIN                # 0 at the axis, 12 <= top tick 15
    assert abs((bottom - one[1][1]) / (bottom - one[0][1]) - 4) < 0.01        # 12 / 3 on a linear y
    assert three[1][1] >= MARGIN and three[0][0] == WIDTH + MARGIN            # second panel, 70 under its top
    ticks = [t.text for t in root.iter(f"{SVG}text")]
    assert {"1K", "2K", "8K", "15", "80"} <= set(ticks)
