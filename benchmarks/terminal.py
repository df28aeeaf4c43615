"""Results on a terminal: the Markdown tables drawn with rich, wrapped to the terminal's width.

Piped or redirected, the output stays Markdown (what ``eval.md``/``bench.md`` hold).
"""

from __future__ import annotations

import io
import sys
from typing import TextIO

TABLE_ROW = "|"
GAP = 2  # spaces between two columns


def _blocks(markdown: str) -> list[tuple[bool, list[str]]]:
    """``(is_table, lines)`` runs of the text."""
    blocks: list[tuple[bool, list[str]]] = []
    for line in markdown.splitlines():
        is_table = line.startswith(TABLE_ROW)
        if blocks and blocks[-1][0] == is_table:
            blocks[-1][1].append(line)
        else:
            blocks.append((is_table, [line]))
    return blocks


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip(TABLE_ROW).split(TABLE_ROW)]


def _width(column: list[str]) -> int:
    """A column's width: its longest value, or its header's longest word (headers wrap at spaces)."""
    return max(max((len(cell) for cell in column[1:]), default=0), *(len(w) for w in column[0].split()))


def _chunks(widths: list[int], width: int, gap: int) -> list[list[int]]:
    """Columns after the first, packed into groups that fit ``width`` beside the first column."""
    chunks: list[list[int]] = [[]]
    used = widths[0]
    for i in range(1, len(widths)):
        if chunks[-1] and used + gap + widths[i] > width:
            chunks.append([])
            used = widths[0]
        chunks[-1].append(i)
        used += gap + widths[i]
    return chunks


def render(markdown: str, width: int) -> str:
    """``markdown`` as a terminal of ``width`` columns shows it: a table too wide goes on in a second
    block below (the cache column repeated), values never cut."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, highlight=False, emoji=False)
    for is_table, lines in _blocks(markdown):
        if not is_table:
            console.print("\n".join(lines), markup=False)
            continue
        rows = [_cells(lines[0]), *(_cells(line) for line in lines[2:])]
        widths = [_width([row[i] for row in rows]) for i in range(len(rows[0]))]
        for chunk in _chunks(widths, width, GAP):
            table = Table(
                box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, GAP // 2), collapse_padding=True
            )
            for i in (0, *chunk):
                justify = "left" if i == 0 else "right"
                table.add_column(rows[0][i], justify=justify, min_width=widths[i], max_width=widths[i])
            for row in rows[1:]:
                table.add_row(*(row[i] for i in (0, *chunk)))
            console.print(table)
    return out.getvalue()


def show(markdown: str, stream: TextIO | None = None) -> None:
    """Print results: wrapped tables on a terminal, Markdown otherwise."""
    stream = stream or sys.stdout
    if not stream.isatty():
        stream.write(markdown if markdown.endswith("\n") else markdown + "\n")
        return
    import shutil

    stream.write(render(markdown, shutil.get_terminal_size().columns))
