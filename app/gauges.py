"""A one-line gauge: stacked segments against a fixed total, so a hard limit is visible.

Used for unified memory (MLX active and the rest of the system's used memory
against the machine's total, with the MLX peak marked) and for the KV cache
(kept entries against the allocated capacity and the budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from mlxevict.memory import format_bytes  # noqa: F401 (one byte format, GiB/MiB, in the CLI and the TUI)

GiB = 1024**3


def format_count(n: int) -> str:
    """An integer with thousands separators: 12,345."""
    return f"{n:,}"


@dataclass(frozen=True)
class Segment:
    """A part of the bar: ``value`` in the gauge's units, drawn with component class ``style``."""

    value: float
    style: str


class Gauge(Widget):
    """A bar of stacked segments over ``total``, with an optional marker (e.g. a peak).

    The fill turns to the warning and then the error colour past ``WARN`` and
    ``DANGER`` of the total, so nearing the machine's limit is hard to miss.
    """

    COMPONENT_CLASSES = {
        "gauge--primary",
        "gauge--secondary",
        "gauge--empty",
        "gauge--marker",
        "gauge--warning",
        "gauge--danger",
    }

    DEFAULT_CSS = """
    Gauge { height: 1; width: 1fr; }
    Gauge > .gauge--primary { color: $accent; }
    Gauge > .gauge--secondary { color: $primary 60%; }
    Gauge > .gauge--empty { color: $foreground 20%; }
    Gauge > .gauge--marker { color: $text; text-style: bold; }
    Gauge > .gauge--warning { color: $warning; }
    Gauge > .gauge--danger { color: $error; }
    """

    WARN = 0.75
    DANGER = 0.9

    def __init__(self, *, alarm: bool = True, id: str | None = None) -> None:
        """Args: alarm: colour the fill by how full the gauge is (memory: yes; a cache held at its budget: no)."""
        super().__init__(id=id)
        self.alarm = alarm

    segments: reactive[tuple[Segment, ...]] = reactive(tuple, layout=False)
    total: reactive[float] = reactive(0.0)
    marker: reactive[float | None] = reactive(None)

    def set(self, segments: tuple[Segment, ...], total: float, marker: float | None = None) -> None:
        """Replace the bar's contents (one refresh)."""
        self.set_reactive(Gauge.segments, tuple(segments))
        self.set_reactive(Gauge.total, float(total))
        self.set_reactive(Gauge.marker, marker)
        self.refresh()

    def render(self) -> Text:
        width = max(1, self.size.width)
        text = Text()
        if self.total <= 0:
            text.append("░" * width, self.get_component_rich_style("gauge--empty"))
            return text
        filled = sum(s.value for s in self.segments)
        level = filled / self.total
        alarm = None
        if self.alarm:
            alarm = "gauge--danger" if level >= self.DANGER else "gauge--warning" if level >= self.WARN else None
        used = 0
        first_cells = 0
        for i, segment in enumerate(self.segments):
            cells = round(segment.value / self.total * width)
            if segment.value > 0:
                cells = max(1, cells)  # a small but real amount stays visible
            cells = max(0, min(cells, width - used))
            first_cells = cells if i == 0 else first_cells
            style = alarm if alarm and segment.style == "gauge--primary" else segment.style
            text.append("█" * cells, self.get_component_rich_style(style))
            used += cells
        text.append("░" * (width - used), self.get_component_rich_style("gauge--empty"))
        if self.marker is not None and 0 < self.marker <= self.total:
            at = min(width - 1, int(self.marker / self.total * width))  # the cell the marker falls in
            if at < first_cells:  # inside the first segment: nothing beyond it to mark
                return text
            text = text[:at] + Text("▌", self.get_component_rich_style("gauge--marker")) + text[at + 1 :]
        return text


def scale_line(total_bytes: float, width: int) -> str:
    """Tick labels under a memory gauge: ``0``, every 4/8/16 GB, and the total at the right end."""
    width = max(8, width)
    total_gb = total_bytes / GiB
    end = f"{round(total_gb, 1):g} GB"
    line = [" "] * width
    line[0] = "0"
    step = next((s for s in (1, 2, 4, 8, 16, 32, 64, 128) if total_gb / s <= width / 6), 256)
    mark = step
    while mark < total_gb - step / 2:
        at = round(mark / total_gb * width)
        label = f"{mark:g}"
        if at + len(label) < width - len(end) - 1:
            line[at : at + len(label)] = label
        mark += step
    line[width - len(end) :] = end
    return "".join(line)
