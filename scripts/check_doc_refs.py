"""Check that every ``§`` section reference in the repository points at a section of a document inside it.

A reference is a section sign followed by a section number (7, 3.10, or a range 3.4–3.7). It belongs to the
nearest ``*.md`` file name before it on the same line (as in "``docs/spec/model-v41.md`` §3.3, §3.9"); in a Markdown
file a reference with no file name before it means the file itself. A reference is good when its file exists in the
repository (path from the repository root, or relative to the referring file) and has a heading with that number
(``## 7.`` / ``### 3.10``). Everything else is reported:

* ``outside``: the named document is not in the repository (a bare ``docs/spec/engine.md`` once meant a file beside the
  repository);
* ``no-section``: the document exists but has no heading with that number;
* ``unqualified``: a reference in a non-Markdown file with no document named before it on its line.

Scanned: git-tracked (or, outside a git checkout, all) ``*.py``, ``*.md``, ``*.toml``, ``*.cfg``, ``*.txt``,
``*.yaml`` files except the bundled model and this checker's own test, whose fixtures are bad references on purpose.
Exit status 1 if anything is reported.

Usage::

    python scripts/check_doc_refs.py [--root ROOT] [PATH ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SUFFIXES = (".py", ".md", ".toml", ".cfg", ".txt", ".yaml", ".yml")
EXCLUDED_DIRS = ("dinfer_jax/bundled/", ".git/")
EXCLUDED_FILES = ("tests/test_doc_refs.py",)
_DOC = re.compile(r"[\w./-]*\.md\b")
_SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)")
_HEADING = re.compile(r"^#{1,6}\s+(\d+(?:\.\d+)*)[.\s]")


@dataclass(frozen=True)
class Finding:
    """One bad reference: where it is, what it says, and why it is bad."""

    path: str
    line: int
    ref: str
    kind: str  # "outside" | "no-section" | "unqualified"
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.ref} ({self.detail})"


@dataclass(frozen=True)
class Reference:
    """A ``§`` reference as written: the document name before it (or None) and the section number."""

    line: int
    doc: str | None
    section: str


def find_references(text: str, *, markdown: bool = False) -> list[Reference]:
    """Every ``§`` reference of ``text`` with the nearest ``*.md`` name before it on its line (in ``markdown``,
    fenced code blocks are code, not references, and are skipped)."""
    refs = []
    in_code = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if markdown and line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in _SECTION.finditer(line):
            docs = [d.group(0) for d in _DOC.finditer(line, 0, m.start())]
            refs.append(Reference(lineno, docs[-1] if docs else None, m.group(1)))
    return refs


@cache
def section_numbers(doc: Path) -> frozenset[str]:
    """Section numbers of the headings of a Markdown file (``## 3.4 RoPE`` -> ``3.4``)."""
    nums = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = _HEADING.match(line)
        if m:
            nums.add(m.group(1))
    return frozenset(nums)


def resolve_doc(root: Path, referrer: Path, doc: str) -> Path | None:
    """The repository file a document name means: from the repository root, else relative to the referrer."""
    for base in (root, referrer.parent):
        cand = (base / doc).resolve()
        if cand.is_file() and cand.is_relative_to(root.resolve()):
            return cand
    return None


def check_file(root: Path, path: Path) -> list[Finding]:
    """Findings of one file (``path`` absolute or relative to ``root``)."""
    path = path if path.is_absolute() else root / path
    rel = path.relative_to(root).as_posix()
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    findings = []
    for ref in find_references(text, markdown=path.suffix == ".md"):
        shown = f"{ref.doc} §{ref.section}" if ref.doc else f"§{ref.section}"
        if ref.doc is None:
            if path.suffix != ".md":
                findings.append(Finding(rel, ref.line, shown, "unqualified", "name the document before the §"))
                continue
            target: Path | None = path
        else:
            target = resolve_doc(root, path, ref.doc)
        if target is None:
            findings.append(Finding(rel, ref.line, shown, "outside", f"{ref.doc} is not a file in the repository"))
        elif ref.section not in section_numbers(target):
            findings.append(Finding(rel, ref.line, shown, "no-section",
                                    f"{target.relative_to(root.resolve())} has no heading numbered {ref.section}"))
    return findings


def scanned_files(root: Path) -> list[Path]:
    """Files to check: git-tracked when ``root`` is a git checkout, else every file, filtered by suffix."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    return sorted(root / n for n in names
                  if n.endswith(SUFFIXES) and not n.startswith(EXCLUDED_DIRS) and n not in EXCLUDED_FILES
                  and (root / n).is_file())


def check(root: Path, paths: list[Path] | None = None) -> list[Finding]:
    """Findings over ``paths`` (default: :func:`scanned_files`)."""
    root = root.resolve()
    files = scanned_files(root) if not paths else [p.resolve() for p in paths]
    return [f for p in files for f in check_file(root, p)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="repository root")
    ap.add_argument("paths", nargs="*", type=Path, help="only these files (default: the whole repository)")
    args = ap.parse_args(argv)
    findings = check(args.root, args.paths)
    for f in findings:
        print(f)
    if findings:
        print(f"{len(findings)} section reference(s) do not point at a section inside the repository",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
