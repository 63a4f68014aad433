"""``python -m flops_callbacks``: the command line (:mod:`flops_callbacks.cli`)."""

from __future__ import annotations

from flops_callbacks.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
