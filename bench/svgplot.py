"""A tiny, dependency-free SVG chart writer: line charts and grouped bar charts.

Enough for the benchmark report; nothing here knows about the scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
FONT = 'font-family="sans-serif" font-size="12"'


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (x, y); y may be NaN for a missing point


@dataclass(frozen=True)
class Box:
    """A chart's place on the canvas: the plotting area inside the margins."""

    left: float
    top: float
    width: float
    height: float


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    return ticks


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def line_chart(
    box: Box,
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    log_y: bool = False,
) -> list[str]:
    """SVG elements of one line chart inside ``box``."""
    xs = [x for s in series for x, y in s.points if math.isfinite(y)]
    ys = [y for s in series for _, y in s.points if math.isfinite(y) and (y > 0 or not log_y)]
    if not xs or not ys:
        return [_text(box.left, box.top, f"{title}: no data")]
    x_lo, x_hi = 0.0, max(xs) * 1.05
    if log_y:
        y_lo = 10 ** math.floor(math.log10(min(ys)))
        y_hi = 10 ** math.ceil(math.log10(max(ys)))
        y_ticks = [10.0**k for k in range(round(math.log10(y_lo)), round(math.log10(y_hi)) + 1)]
    else:
        y_lo, y_hi = 0.0, max(ys) * 1.05
        y_ticks = _nice_ticks(y_lo, y_hi)

    def px(x: float) -> float:
        return box.left + (x - x_lo) / (x_hi - x_lo) * box.width

    def py(y: float) -> float:
        if log_y:
            share = (math.log10(y) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))
        else:
            share = (y - y_lo) / (y_hi - y_lo)
        return box.top + box.height - share * box.height

    out = _frame(box, title, x_label, y_label)
    for tick in _nice_ticks(x_lo, x_hi):
        out.append(_line(px(tick), box.top + box.height, px(tick), box.top + box.height + 4))
        out.append(_text(px(tick), box.top + box.height + 16, _fmt(tick), anchor="middle"))
    for tick in y_ticks:
        if not y_lo <= tick <= y_hi:
            continue
        out.append(_line(box.left, py(tick), box.left + box.width, py(tick), "#e0e0e0"))
        out.append(_text(box.left - 6, py(tick) + 4, _fmt(tick), anchor="end"))
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in sorted(s.points):
            if math.isfinite(y) and (y > 0 or not log_y):
                runs[-1].append((px(x), py(min(max(y, y_lo), y_hi))))
            elif runs[-1]:
                runs.append([])
        for run in runs:
            if len(run) > 1:
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
                out.append(
                    f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
                )
            for x, y in run:
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        out += _legend_entry(box, i, s.label, colour)
    return out


def bar_chart(
    box: Box,
    groups: Sequence[str],
    series: Sequence[Series],
    *,
    title: str,
    y_label: str,
) -> list[str]:
    """Grouped bars: ``series[k].points[g] = (g, value)`` is bar ``k`` of group ``g``."""
    values = [y for s in series for _, y in s.points if math.isfinite(y)]
    if not values or not groups:
        return [_text(box.left, box.top, f"{title}: no data")]
    y_hi = max(values) * 1.1
    ticks = _nice_ticks(0.0, y_hi)
    y_hi = max(y_hi, ticks[-1])

    def py(y: float) -> float:
        return box.top + box.height - y / y_hi * box.height

    out = _frame(box, title, "", y_label)
    for tick in ticks:
        out.append(_line(box.left, py(tick), box.left + box.width, py(tick), "#e0e0e0"))
        out.append(_text(box.left - 6, py(tick) + 4, _fmt(tick), anchor="end"))
    group_w = box.width / len(groups)
    bar_w = group_w * 0.8 / max(len(series), 1)
    for g, name in enumerate(groups):
        gx = box.left + g * group_w
        out.append(_text(gx + group_w / 2, box.top + box.height + 16, name, anchor="middle"))
        for k, s in enumerate(series):
            value = next((y for x, y in s.points if int(x) == g), math.nan)
            if not math.isfinite(value):
                continue
            x = gx + group_w * 0.1 + k * bar_w
            colour = PALETTE[k % len(PALETTE)]
            out.append(
                f'<rect x="{x:.1f}" y="{py(value):.1f}" width="{bar_w - 2:.1f}" '
                f'height="{box.top + box.height - py(value):.1f}" fill="{colour}"/>'
            )
            out.append(_text(x + bar_w / 2 - 1, py(value) - 4, _fmt(round(value)), "middle"))
    for k, s in enumerate(series):
        out += _legend_entry(box, k, s.label, PALETTE[k % len(PALETTE)])
    return out


def document(width: int, height: int, elements: Sequence[str]) -> str:
    body = "\n".join(elements)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">\n'
        f'<rect width="{width}" height="{height}" fill="white"/>\n{body}\n</svg>\n'
    )


def _frame(box: Box, title: str, x_label: str, y_label: str) -> list[str]:
    bottom = box.top + box.height
    out = [
        _line(box.left, bottom, box.left + box.width, bottom),
        _line(box.left, box.top, box.left, bottom),
        _text(box.left + box.width / 2, box.top - 10, title, anchor="middle", bold=True),
    ]
    if x_label:
        out.append(_text(box.left + box.width / 2, bottom + 34, x_label, anchor="middle"))
    cx, cy = box.left - 48, box.top + box.height / 2
    out.append(
        f'<text x="{cx:.1f}" y="{cy:.1f}" {FONT} text-anchor="middle" '
        f'transform="rotate(-90 {cx:.1f} {cy:.1f})">{escape(y_label)}</text>'
    )
    return out


def _legend_entry(box: Box, index: int, label: str, colour: str) -> list[str]:
    x = box.left + 10
    y = box.top + 12 + 16 * index
    return [
        f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="12" height="10" fill="{colour}"/>',
        _text(x + 18, y, label),
    ]


def _line(x1: float, y1: float, x2: float, y2: float, colour: str = "#333") -> str:
    return (
        f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
        f'stroke="{colour}" stroke-width="1"/>'
    )


def _text(x: float, y: float, text: str, anchor: str = "start", bold: bool = False) -> str:
    weight = ' font-weight="bold"' if bold else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" {FONT} text-anchor="{anchor}"{weight}>{escape(text)}</text>'
    )
