"""The docs say what the code says, in the files themselves: the options and metrics tables, the console
sample and the window's numbers are written into the pages by ``docs/generate.py`` and are what it would
write now; they list exactly ``Options``' fields and ``metrics.py``'s names; each option is described
once, in ``Options``; the README is a landing page whose sample console is the docs' one; no page leaves
a part to the site's build; every page is in the site's nav; the package's text carries no history."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import inspect
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from flops_callbacks import metrics as names
from flops_callbacks.integrations.callback_base import SessionCallback
from flops_callbacks.integrations.step_profiler import StepProfiler
from flops_callbacks.options import Options
from flops_callbacks.reporting.console_summary import MAX_LINES
from flops_callbacks.reporting.profile_file import from_json
from flops_callbacks.reporting.publish import picture

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def generate():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_names(markdown: str) -> list[str]:
    """The first column's names of a generated table (`` `name` ``)."""
    return re.findall(r"^\| `([^`]+)` \|", markdown, re.MULTILINE)


def test_the_options_page_lists_exactly_the_fields_of_options_with_their_defaults() -> None:
    page = (DOCS / "options.md").read_text()
    fields = dataclasses.fields(Options)
    assert table_names(page) == [f.name for f in fields]
    assert "| `clean_steps` | `'auto'` | Steps timed with nothing else on the clock" in page
    assert "| `report` | `'summary'` | What the console shows: " in page


def test_the_metrics_page_lists_exactly_the_names_of_metrics_py() -> None:
    page = (DOCS / "metrics.md").read_text()
    defined = {
        value
        for key, value in vars(names).items()
        if key.isupper() and isinstance(value, str) and "/" in value and not value.endswith("/")
    }
    listed = table_names(page)
    assert len(listed) == len(set(listed)) and set(listed) == defined
    assert defined >= {*names.ALL, *names.WITH_PEAK, *names.PADDING, *names.THROUGHPUT}
    # each with the comment it is defined with, and its unit from its name: every row has one
    assert "| `flops_profiler/iter_latency` | s | fwd + bwd + step latency |" in page
    flops = "the median step's model flops (fwd + bwd, on the real tokens: padding apart) / iter latency"
    assert f"| `flops_profiler/flops_per_sec` | flop/s | {flops} |" in page
    assert "| `flops_profiler/comm_overlap` | fraction | " in page
    assert "| `generation/decode_latency_p90` | s | " in page
    units = re.findall(r"^\| `[^`]+` \| ([^|]*) \|", page, re.MULTILINE)
    assert len(units) == len(listed) and all(u.strip() for u in units)


def test_the_any_loop_page_lists_exactly_the_step_profilers_own_arguments_with_their_defaults() -> None:
    page = (DOCS / "any-loop.md").read_text()
    own = [n for n, p in inspect.signature(StepProfiler).parameters.items() if p.kind is not p.VAR_KEYWORD]
    assert (
        table_names(page)
        == own
        == ["model", "accelerator", "fabric", "log", "log_dir", "log_every_n_steps", "max_steps"]
    )
    assert "| `log_every_n_steps` | `50` | optimizer steps between `throughput/*` logs" in page
    assert "| `model` | required | " in page


def test_the_window_numbers_on_the_pages_are_the_window_plans() -> None:
    from flops_callbacks.session.window_plan import MODULE_TIMING_STEPS, before_clean

    before = before_clean()
    page = (DOCS / "how-it-works.md").read_text()
    assert (
        f"**the <!-- plan: MODULE_TIMING_STEPS -->{MODULE_TIMING_STEPS}<!-- /plan --> module-timing" in page
    )
    assert f"`profile_step` + <!-- plan: BEFORE_CLEAN -->{before}<!-- /plan --> + `clean_steps`" in page


def test_every_generated_part_of_every_page_is_what_the_command_writes() -> None:
    docs = generate()
    pages = docs.files()
    assert ROOT / "README.md" in pages and DOCS / "options.md" in pages
    assert docs.stale() == []  # python3 tasks.py docs rewrites a stale one
    # a stale part is found: a table row gone, a number changed
    options = (DOCS / "options.md").read_text()
    assert docs.generated(options.replace("| `clean_steps` |", "| `clean` |")) == options
    how = (DOCS / "how-it-works.md").read_text()
    assert (
        docs.generated(
            how.replace("<!-- plan: MODULE_TIMING_STEPS -->3<", "<!-- plan: MODULE_TIMING_STEPS -->4<")
        )
        == how
    )


def test_no_page_leaves_a_part_to_the_sites_build() -> None:
    """What a page says on the repository is what the site shows: no include, no template, no comment
    whose content a build would put on the page (only the generated parts' empty markers)."""
    markers = re.compile(r"<!-- (generated: \w+|/generated|plan: \w+|/plan) -->")
    for page in generate().files():
        text = page.read_text()
        assert "--8<--" not in text and "{{" not in text, page
        if page.name != "api.md":  # the API reference is the site's rendering of the docstrings
            assert not re.search(r"^::: ", text, re.MULTILINE), page
        comments = re.findall(r"<!--.*?-->", text, re.DOTALL)
        assert all(markers.fullmatch(c) for c in comments), (
            page,
            [c for c in comments if not markers.fullmatch(c)],
        )


def test_each_option_is_described_once_in_options_and_the_adapters_point_there() -> None:
    options = [f.name for f in dataclasses.fields(Options)]
    adapters = [SessionCallback, StepProfiler]
    try:
        from flops_callbacks.integrations.hf import HFFlopsCallback
        from flops_callbacks.integrations.lightning import FlopsProfilerCallback

        adapters += [FlopsProfilerCallback, HFFlopsCallback]
    except ImportError:  # a framework is not installed: its adapter cannot repeat anything here
        pass
    for adapter in adapters:
        doc = adapter.__doc__ or ""
        repeated = [name for name in options if re.search(rf"^\s+{name}: ", doc, re.MULTILINE)]
        assert repeated == [], (adapter.__name__, repeated)
        assert "flops_callbacks.options.Options" in doc, adapter.__name__
    assert set(generate().option_descriptions()) == set(options)


def test_the_readme_is_a_landing_page_with_the_docs_sample_console() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert readme.index("python3 tasks.py demo") < readme.index("## Install")
    assert "python3 tasks.py test" in readme
    fenced = r"<!-- generated: console -->\n```text\n(.*?)```\n<!-- /generated -->"
    block = re.search(fenced, readme, re.DOTALL)
    assert block is not None
    sample = (DOCS / "snippets" / "console.txt").read_text()
    assert block[1] == sample  # both written by docs/console_sample.py
    assert len(sample.splitlines()) <= MAX_LINES
    for page in re.findall(r"\]\((docs/[\w-]+\.md)\)", readme):
        assert (ROOT / page).is_file(), page


def test_every_page_is_in_the_sites_nav() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    in_nav = set(re.findall(r":\s+([\w-]+\.md)\s*$", config, re.MULTILINE))
    assert in_nav == {page.name for page in DOCS.glob("*.md")}


def test_the_package_says_no_history() -> None:
    for path in (ROOT / "flops_callbacks").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"issue \d|issue #\d", text, re.IGNORECASE), path
        assert "was available to this project" not in text, path


def png_texts(path: Path) -> dict[str, str]:
    """The compressed text chunks (zTXt) of a PNG, by keyword."""
    blob, pos, found = path.read_bytes(), 8, {}
    while pos < len(blob):
        length, kind = struct.unpack(">I4s", blob[pos : pos + 8])
        if kind == b"zTXt":
            keyword, rest = blob[pos + 8 : pos + 8 + length].split(b"\0", 1)
            found[keyword.decode("latin-1")] = zlib.decompress(rest[1:]).decode("utf-8")
        pos += 12 + length
    return found


def test_the_docs_picture_is_todays_renderers_drawing_of_its_window() -> None:
    """docs/profile.png holds the page it was shot from and the window that page draws
    (``python3 tasks.py picture`` writes all three): the page is what today's renderer draws of that
    window, word for word, so a change to the picture's words or sections fails here until the picture
    is drawn again."""
    texts = png_texts(DOCS / "profile.png")
    page = texts["flops_callbacks page"]
    result = from_json(json.loads(texts["flops_callbacks profile"]), "docs/profile.png").result
    assert page == picture(result)
    # what the picture shows: MFU against a measured peak, said so, and the roofline drawn
    assert re.search(r"<dt>MFU \(measured peak\)</dt><dd>\d+\.\d\d%</dd>", page)
    assert result.peak is not None and result.peak.source.startswith("measured: ")
    assert result.bandwidth is not None and result.rooflines()
    assert len(result.profile.modules) > 100  # GPT-2 124M's tree: every block, every layer
    # the words the issue found stale are no longer the renderer's
    for stale in ("flops counted at step", "modules timed at step"):
        assert stale not in page


def test_the_api_page_lists_every_public_name() -> None:
    import flops_callbacks

    page = (DOCS / "api.md").read_text()
    shown = set(re.findall(r"^::: [\w.]+\.(\w+)$", page, re.MULTILINE))
    for members in re.findall(r"^\s+members: \[(.*)\]$", page, re.MULTILINE):
        shown |= {name.strip() for name in members.split(",")}
    assert set(flops_callbacks.__all__) - shown == set()


def test_the_site_builds_strictly_and_shows_no_rest(tmp_path: Path) -> None:
    """The site as ``python3 tasks.py docs`` builds it: strict (no broken link or anchor), and no
    docstring's reST role or literal-block marker left raw on any page."""
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    pages = list(site.rglob("*.html"))
    assert len(pages) > len(list(DOCS.glob("*.md")))  # every page, and the 404
    for page in pages:
        text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
        raw = re.findall(r":(?:class|mod|func|meth|data|attr):`|\w::(?:\s|$)|(?<![:\w])::(?![:\w])", text)
        assert raw == [], (page.relative_to(site), raw)
