"""The one writer of files: every report, JSON, picture and trace the package writes goes through here,
and the one check, at the start of a run, that they can be written at all."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["unwritable_reason", "write_text"]


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` whole, its folders created; returns the path.

    Args:
        path: the file to write.
        text: what it holds.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def unwritable_reason(folder: str | Path) -> str | None:
    """Why files could not be written into ``folder`` (created if missing), or None when they can.

    Checked without leaving anything behind: the nearest existing ancestor must be a folder in which
    an anonymous temporary file can be made (root passes permission bits, not a read-only or virtual
    file system such as ``/proc``).

    Args:
        folder: the folder the files go into.
    """
    existing = Path(folder)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"{existing} cannot be written ({error.strerror or error})"
    return None
