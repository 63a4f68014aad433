"""A griffe extension for the API page: the docstrings' reST as Markdown, so that the site shows code and
examples, not roles. ``:class:`~a.b.C``` reads `C` (``:mod:``, ``:func:``, ``:meth:``, ``:data:``,
``:attr:``, ``:exc:``, ``:obj:`` alike; without ``~`` the whole name), ``literal`` reads `literal`, and
a paragraph ending in ``::`` ends in ``:`` with its indented block fenced as Python code.

The docstrings stay reST for ``help()`` and the editors that read them; mkdocstrings' Google style reads
Markdown, so the two meet here, at the site's build, for every object the API page renders.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

__all__ = ["RestToMarkdown", "markdown"]

ROLE = re.compile(r":(?:class|mod|func|meth|data|attr|exc|obj):`(~?)([^`]+)`")
LITERAL = re.compile(r"``(.+?)``")


def _role(found: re.Match[str]) -> str:
    name = found[2]
    return f"`{name.rsplit('.', 1)[-1] if found[1] else name}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _blocks(lines: list[str]) -> list[str]:
    """Each ``::`` paragraph's indented block fenced; the ``::`` read as ``:`` (or dropped alone)."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        head = line.rstrip()[:-2].rstrip()
        if head.strip():
            out.append(head + ":")
        base, i = _indent(line), i + 1
        block: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            block.append(lines[i])
            i += 1
        while block and not block[-1].strip():
            block.pop()
        body = textwrap.dedent("\n".join(block)).strip("\n").splitlines()
        pad = " " * base
        out += ["", pad + "```python", *(pad + code if code else "" for code in body), pad + "```", ""]
    return out


def markdown(text: str) -> str:
    """A reST docstring's roles, literals and literal blocks as Markdown.

    Args:
        text: the docstring.
    """
    text = ROLE.sub(_role, text)
    text = "\n".join(_blocks(text.splitlines()))
    return LITERAL.sub(r"`\1`", text)


class RestToMarkdown(griffe.Extension):
    """Every object's docstring through :func:`markdown`, once the tree is built."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
