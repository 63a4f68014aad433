"""``python -m flops_callbacks``: the command line (:mod:`flops_callbacks.reporting.cli`)."""

from __future__ import annotations

from flops_callbacks.reporting.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
