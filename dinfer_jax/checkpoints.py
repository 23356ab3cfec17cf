"""Where named checkpoints live: ``"default"`` is the small trained model bundled with the repository."""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
REGISTRY = {"default": BUNDLED_DIR / "default"}


def resolve_checkpoint(name: str) -> Path | None:
    """A checkpoint directory for ``name`` (a path, or a registered name such as ``"default"``), else None.

    Raises FileNotFoundError when a registered name's files are missing.
    """
    p = Path(name)
    if p.is_dir():
        return p
    if name in REGISTRY:
        path = REGISTRY[name]
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"registered checkpoint {name!r} is missing at {path}")
        return path
    return None
