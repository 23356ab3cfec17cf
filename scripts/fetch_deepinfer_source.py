"""Fetch the sources of DeepInfer 0.1.0 and tile-kernels 2.1.0 (both Apache-2.0) for the test reference harness.

The tests compare our functions with the pure-PyTorch ``*_ref`` twins that ship inside those two packages
(``tests/deepinfer_refs.py`` executes them without importing the packages, which need CUDA). Both come from PyPI
through ``pip download``:

* ``deepinfer==0.1.0`` is an sdist only. pip downloads and unpacks it, then fails to build its metadata (the build
  needs CUDA torch); ``--no-clean`` keeps the unpacked tree in pip's temporary directory, which is all we need. The
  failure is expected; success is judged by the unpacked files being there.
* ``tile-kernels==2.1.0`` is a pure-Python wheel; its ``tile_kernels/`` package directory is extracted.

Result layout (what ``tests/deepinfer_refs.py`` reads)::

    DEST/deepinfer-0.1.0/deepinfer/...   the DeepInfer package source
    DEST/tile_kernels/...                the tile-kernels package

The default destination is the cache ``${XDG_CACHE_HOME:-~/.cache}/dinfer_jax/deepinfer-src``; an existing complete
tree there is reused (nothing is downloaded). A tree is built in a private temporary sibling and renamed into place
once complete, so a directory that exists is complete and concurrent callers (pytest-xdist workers) need no lock.

Usage::

    python scripts/fetch_deepinfer_source.py [DEST] [--force]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEEPINFER = "deepinfer==0.1.0"
TILE_KERNELS = "tile-kernels==2.1.0"
DEEPINFER_DIR = "deepinfer-0.1.0"  # holds the package directory ``deepinfer/``
TILE_KERNELS_DIR = "tile_kernels"  # the package directory itself
# Files whose presence marks a usable tree (one from each package).
MARKERS = (f"{DEEPINFER_DIR}/deepinfer/model_executor/layers/tilelang_ops/compress.py",
           f"{TILE_KERNELS_DIR}/torch/cast.py")
PIP_TIMEOUT_S = 600


class FetchError(RuntimeError):
    """The sources could not be downloaded or unpacked (no network, no pip, a changed package layout)."""


def default_dest() -> Path:
    """The cache directory the test harness reads when ``DINFER_DEEPINFER_SRC`` is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dinfer_jax" / "deepinfer-src"


def is_complete(root: Path) -> bool:
    """Whether ``root`` holds both source trees."""
    return all((root / m).is_file() for m in MARKERS)


def _pip(args: list[str], *, tmpdir: Path, python: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmpdir), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        return subprocess.run([python, "-m", "pip", "download", "--no-deps", *args], env=env, capture_output=True,
                              text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise FetchError(f"could not run pip ({python} -m pip download): {e}") from e


def _fetch_deepinfer(work: Path, out: Path, python: str) -> None:
    proc = _pip([DEEPINFER, "--no-binary", ":all:", "--no-build-isolation", "--no-clean", "--python-version", "3.12",
                 "-d", str(work / "dl")], tmpdir=work, python=python)
    found = sorted(p for p in work.glob("*/deepinfer_*") if (p / "deepinfer").is_dir())
    if not found:
        raise FetchError(f"pip could not download {DEEPINFER} (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    shutil.copytree(found[0], out / DEEPINFER_DIR, symlinks=True)


def _fetch_tile_kernels(work: Path, out: Path, python: str) -> None:
    dl = work / "tk"
    proc = _pip([TILE_KERNELS, "--only-binary=:all:", "--python-version", "3.12", "-d", str(dl)], tmpdir=work,
                python=python)
    wheels = sorted(dl.glob("tile_kernels-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise FetchError(f"pip could not download {TILE_KERNELS} (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        members = [m for m in zf.namelist() if m.startswith(f"{TILE_KERNELS_DIR}/")]
        zf.extractall(out, members)


def fetch(dest: Path | None = None, *, force: bool = False, python: str | None = None) -> Path:
    """Make ``dest`` (default :func:`default_dest`) a complete source tree and return it.

    Reuses a complete tree unless ``force``. Raises :class:`FetchError` when the download fails.
    """
    dest = Path(dest) if dest is not None else default_dest()
    if is_complete(dest) and not force:
        return dest
    python = python or sys.executable
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=dest.parent))
    try:
        out = work / "out"
        out.mkdir()
        _fetch_deepinfer(work, out, python)
        _fetch_tile_kernels(work, out, python)
        if not is_complete(out):
            raise FetchError(f"downloaded trees lack {MARKERS}: the package layout changed")
        if force and dest.exists():
            shutil.rmtree(dest)
        try:
            out.rename(dest)
        except OSError as e:  # another process renamed its copy first, or a stale directory is in the way
            if not is_complete(dest):
                raise FetchError(f"{dest} exists but is incomplete; remove it and retry") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", nargs="?", type=Path, default=None, help=f"destination (default {default_dest()})")
    ap.add_argument("--force", action="store_true", help="download again even if a complete tree exists")
    args = ap.parse_args(argv)
    try:
        root = fetch(args.dest, force=args.force)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"DeepInfer source: {root / DEEPINFER_DIR}")
    print(f"tile-kernels source: {root / TILE_KERNELS_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
