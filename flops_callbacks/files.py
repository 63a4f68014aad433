"""The one writer of files: every report, JSON, picture and trace the package writes goes through here."""

from __future__ import annotations

from pathlib import Path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole, its folders created; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
