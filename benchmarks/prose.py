"""Natural English prose that ships with Python, split into a tuning and a test half.

Three sources, all inside every Python (Linux, macOS, Windows):

- ``pydoc``: the language reference topics (``pydoc_data.topics``);
- ``docstrings``: the docstrings of common standard-library modules, their classes and functions;
- ``license``: Python's ``LICENSE.txt`` (its history and terms, in prose).

Each source is cut into documents (a topic, a module, the licence), and a document longer
than :data:`PART_CHARS` into parts at paragraph ends. Each part belongs to exactly one half:
the first by a hash of the document's name, the next ones alternating, so that a long
document (the licence is the only one of its source) lends text of its kind to both
halves. Texts of the tuning half never appear in the test half, whatever the seed.
"""

from __future__ import annotations

import inspect
import itertools
import os
import random
import sysconfig
import zlib
from dataclasses import dataclass
from functools import lru_cache

SPLITS = ("tuning", "test")
DOCSTRING_MODULES = (
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "email.message", "enum", "functools", "heapq", "http.client", "inspect", "itertools", "json",
    "logging", "multiprocessing", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "threading", "typing", "unittest", "urllib.request", "uuid",
    "zipfile", "textwrap", "difflib", "fractions", "ipaddress", "smtplib", "sched", "queue", "selectors",
)  # fmt: skip
MIN_PARAGRAPH = 120  # characters: shorter paragraphs are headings, signatures or list items
PART_CHARS = 3000  # characters: a longer document is cut into parts of about equal size


@dataclass(frozen=True)
class Document:
    source: str
    name: str
    text: str
    part: int = 0

    @property
    def split(self) -> str:
        """``"tuning"`` or ``"test"``: fixed by the document's name and part, never by a seed."""
        return SPLITS[(zlib.crc32(f"{self.source}:{self.name}".encode()) + self.part) % 2]


def cut(text: str, size: int = PART_CHARS) -> list[str]:
    """``text`` in ``ceil(len / size)`` parts of about equal length, cut at the paragraph
    ends nearest to equal shares (a part may run past ``size`` by part of a paragraph)."""
    paragraphs = text.split("\n\n")
    ends = list(itertools.accumulate(len(p) + 2 for p in paragraphs))
    n = -(-len(text) // size)
    cuts = sorted({min(range(len(ends)), key=lambda j: abs(ends[j] - k * len(text) / n)) + 1 for k in range(1, n)})
    bounds = [0, *[c for c in cuts if c < len(paragraphs)], len(paragraphs)]
    return ["\n\n".join(paragraphs[a:b]) for a, b in zip(bounds, bounds[1:]) if a < b]


def prose(text: str) -> str:
    """The prose paragraphs of ``text``: no indented code, no doctests, whitespace collapsed."""
    paragraphs = []
    for para in text.split("\n\n"):
        lines = [line for line in para.splitlines() if line.strip()]
        if not lines or any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue
        joined = " ".join(" ".join(lines).split())
        if len(joined) >= MIN_PARAGRAPH and not joined.startswith(("[", "|", "+", "=", "-")):
            paragraphs.append(joined)
    return "\n\n".join(paragraphs)


def _pydoc() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document("pydoc", name, prose(text)) for name, text in sorted(topics.items())]


def _docstrings() -> list[Document]:
    import importlib

    docs = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        parts = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                parts.append(inspect.getdoc(obj) or "")
        docs.append(Document("docstrings", name, prose("\n\n".join(parts))))
    return docs


def license_path() -> str:
    return os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")


def _license() -> list[Document]:
    path = license_path()
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"Python's licence text is missing at {path}; this Python was installed without it "
            "(reinstall Python, or run the short suite: mlxevict eval --suite short)"
        )
    with open(path, encoding="utf-8") as f:
        return [Document("license", "LICENSE.txt", prose(f.read()))]


@lru_cache(maxsize=None)
def documents(split: str) -> tuple[Document, ...]:
    """Every non-empty document part of one half (``"tuning"`` or ``"test"``), sources interleaved.

    Raises:
        ValueError: an unknown split.
        FileNotFoundError: a source is missing (one line naming it).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; choose one of {SPLITS}")
    by_source = [
        [part for d in load() if d.text for part in _parts(d) if part.split == split]
        for load in (_pydoc, _docstrings, _license)
    ]
    out: list[Document] = []
    for i in range(max(map(len, by_source))):
        out += [docs[i] for docs in by_source if i < len(docs)]
    return tuple(out)


def _parts(doc: Document) -> list[Document]:
    return [Document(doc.source, doc.name, text, k) for k, text in enumerate(cut(doc.text))]


def sources(split: str) -> list[str]:
    return sorted({d.source for d in documents(split)})


def stream(split: str, seed: int, min_chars: int, first_source: int = 0, lead: int | None = None) -> str:
    """Documents of ``split`` in a seeded order, starting with source ``first_source`` (mod #sources).

    ``lead``: start with that source's ``lead``-th part in an order fixed by the split alone,
    so that texts asked with leads 0, 1, ... never start alike; ``None``: a seeded part.
    Joined until they hold ``min_chars`` characters; documents repeat only if the half runs out.

    Raises:
        ValueError: the source has no ``lead``-th part in this half.
    """
    docs = list(documents(split))
    random.Random(f"prose-{split}-{seed}").shuffle(docs)
    names = sorted({d.source for d in docs})
    source = names[first_source % len(names)]
    docs.sort(key=lambda d: d.source != source)  # stable: the seeded order within each group
    if lead is not None:
        group = [d for d in documents(split) if d.source == source]
        random.Random(f"prose-{split}-lead").shuffle(group)
        if lead >= len(group):
            raise ValueError(f"the {split} half has {len(group)} parts of {source}; a text led by part {lead + 1} needs more")
        docs.remove(group[lead])
        docs.insert(0, group[lead])
    parts, size, i = [], 0, 0
    while size < min_chars:
        text = docs[i % len(docs)].text
        parts.append(text)
        size += len(text) + 2
        i += 1
    return "\n\n".join(parts)
