"""A picture of a profile: one self-contained HTML page with the module tree as an icicle chart.

Widths are forward (or, toggled, backward) latency, colours the achieved FLOPS, hover gives every count
of a module and its per-functional split, a click zooms in. Below it, where both peaks are known, a
roofline chart (log-log: flops per byte against achieved FLOPS, both roofs drawn) has every module as
a point sized by its latency; a click on a point zooms the tree to that module.
Why a page and not a PNG or SVG: a 32-layer model has hundreds of modules, too many to label at once;
zooming and hovering make them readable. Why no plotting library: the page must open anywhere, offline,
years later, so its script and style are inline (``picture.html``, the template next to this module) and
nothing is fetched.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from importlib.resources import files
from typing import Any

from flops_callbacks.profile import Profile
from flops_callbacks.reporting.tree_check import TreeCheck

__all__ = ["render_html"]

_SLOTS = re.compile(r"\{\{(title|headline|notes|data)\}\}")


def render_html(
    profile: Profile,
    *,
    title: str = "flops_callbacks profile",
    headline: Sequence[tuple[str, str]] = (),
    roofline: Mapping[str, Any] | None = None,
    no_roofline: str = "",
    doubts: TreeCheck | None = None,
    against: Mapping[str, Any] | None = None,
) -> str:
    """The page for ``profile``: the module tree, a chart, and the rows and notes above them.

    Args:
        profile: the profile drawn.
        title: the page's title.
        headline: (label, value) rows shown above the chart.
        roofline: ``peak_flops``, ``peak_bandwidth``, their ``*_source`` and, as ``modules``, per module
            name and pass the :class:`~flops_callbacks.roofline.Roofline` fields: draws the roofline
            chart (None: the chart's place says ``no_roofline``).
        no_roofline: why there is no roofline chart.
        doubts: what the module tree's check found wrong with the module latencies, said above the
            chart and on the modules concerned.
        against: a diff: ``label`` and ``note`` of the run compared against, and ``modules``: its
            latencies by module name, as ``{"fwd": s, "bwd": s, "own_fwd": s, "own_bwd": s}``. Each
            module is coloured by the change of its own time (children's left out) against that run
            instead of its achieved FLOPS, so that a slowed module stands out and not its parents; the
            ``note`` (why the runs are not comparable, if they are not) is said above the chart.
    """
    doubts = doubts or TreeCheck()
    notes = ([against["note"]] if against and against.get("note") else []) + list(doubts.notes)
    rows = "".join(
        f"<div><dt>{html.escape(label)}</dt><dd>{html.escape(value)}</dd></div>" for label, value in headline
    )
    slots = {
        "title": html.escape(title),
        "headline": f'<dl class="headline">{rows}</dl>' if rows else "",
        "notes": (
            '<ul class="doubts">' + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"
            if notes
            else ""
        ),
        # "<" escaped so that no string in the data can close the script element holding it
        "data": json.dumps(
            {
                "modules": _tree(profile, doubts.flagged),
                "roofline": roofline,
                "no_roofline": no_roofline,
                "against": against,
            },
            separators=(",", ":"),
        ).replace("<", "\\u003c"),
    }
    template = files("flops_callbacks.reporting").joinpath("picture.html").read_text(encoding="utf-8")
    return _SLOTS.sub(lambda slot: slots[slot[1]], template)


def _tree(profile: Profile, doubts: dict[str, str]) -> list[dict]:
    """Every module as plain data, depth first from the model, each with its children's indices."""
    order: list[str] = []
    children: dict[str, list[str]] = {}
    pending = [""]
    while pending:
        name = pending.pop()
        order.append(name)
        children[name] = [child.name for child in profile.children(name)]
        pending.extend(reversed(children[name]))
    index = {name: i for i, name in enumerate(order)}
    return [
        {
            **asdict(profile.modules[name]),
            "kids": [index[child] for child in children[name]],
            "doubt": doubts.get(name, ""),  # why its latency is not to be believed ("": it is)
        }
        for name in order
    ]
