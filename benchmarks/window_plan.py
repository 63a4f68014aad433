"""The window's steps for the scripts that import them from here; :mod:`common` holds them."""

from __future__ import annotations

from common import window_steps

__all__ = ["window_steps"]
