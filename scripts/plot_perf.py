"""Draw a bar chart for every benchmark table in ``docs/perf/*.md``: ``<name>.png`` beside each file.

A table is a Markdown table whose first columns are ``model`` and ``engine`` and which has an ``output tok/s``
column (what ``scripts/bench_generate.py`` writes). Bars: tokens per second per (model, engine), grouped by model.

Usage::

    python scripts/plot_perf.py [FILE.md ...]      # default: every docs/perf/*.md

Needs matplotlib (``pip install -e ".[examples]"``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PERF_DIR = Path(__file__).resolve().parents[1] / "docs" / "perf"
VALUE_COLUMN = "output tok/s"


@dataclass(frozen=True)
class Row:
    """One measured configuration of a benchmark table."""

    model: str
    engine: str
    tokens_per_s: float


def parse_table(text: str) -> list[Row]:
    """Rows of the first Markdown table of ``text`` with ``model``, ``engine`` and ``output tok/s`` columns."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        header = [c.strip() for c in line.strip("|").split("|")]
        if {"model", "engine", VALUE_COLUMN} <= set(header):
            m, e, v = header.index("model"), header.index("engine"), header.index(VALUE_COLUMN)
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                cells = [c.strip() for c in body.strip("|").split("|")]
                value = re.sub(r"[^0-9.]", "", cells[v])
                if value:
                    rows.append(Row(cells[m], re.sub(r"\s*\(.*\)|`", "", cells[e]), float(value)))
            return rows
    return []


def plot_rows(rows: list[Row], title: str, out: Path) -> None:
    """Horizontal bars of tokens/s, one group per model, written to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 0.5 * len(rows) + 1.4), constrained_layout=True)
    models = list(dict.fromkeys(r.model for r in rows))
    colors = {m: f"C{i}" for i, m in enumerate(models)}
    labels = [f"{r.model} · {r.engine}" for r in rows]
    y = list(range(len(rows)))[::-1]
    bars = ax.barh(y, [r.tokens_per_s for r in rows], color=[colors[r.model] for r in rows])
    ax.bar_label(bars, fmt="%.0f", padding=3, fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.12)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="benchmark Markdown files (default: docs/perf/*.md)")
    args = ap.parse_args(argv)
    files = args.files or sorted(PERF_DIR.glob("*.md"))
    status = 0
    for path in files:
        rows = parse_table(path.read_text(encoding="utf-8"))
        if not rows:
            print(f"{path}: no table with model / engine / {VALUE_COLUMN} columns", file=sys.stderr)
            status = 1
            continue
        title = path.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").replace("`", "")
        out = path.with_suffix(".png")
        plot_rows(rows, title, out)
        print(f"{out} ({len(rows)} bars)")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
