"""The docs say what the code says: the options and metrics pages are generated from ``Options`` and
``metrics.py`` (``docs/hooks.py``) and list exactly their fields and names; each option is described once,
in ``Options``; the README is a landing page whose sample console is the docs' one; every page is in the
site's nav; the package's text carries no history."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

from flops_callbacks import metrics as names
from flops_callbacks.integrations.callback_base import SessionCallback
from flops_callbacks.integrations.step_profiler import StepProfiler
from flops_callbacks.options import Options
from flops_callbacks.reporting.console_summary import MAX_LINES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def hooks():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_names(markdown: str) -> list[str]:
    """The first column's names of a generated table (`` `name` ``)."""
    return re.findall(r"^\| `([^`]+)` \|", markdown, re.MULTILINE)


def test_the_options_page_lists_exactly_the_fields_of_options_with_their_defaults() -> None:
    page = hooks().on_page_markdown((DOCS / "options.md").read_text())
    fields = dataclasses.fields(Options)
    assert table_names(page) == [f.name for f in fields]
    assert "| `clean_steps` | `'auto'` | Steps timed with nothing else on the clock" in page
    assert "| `report` | `'summary'` | What the console shows: " in page


def test_the_metrics_page_lists_exactly_the_names_of_metrics_py() -> None:
    page = hooks().on_page_markdown((DOCS / "metrics.md").read_text())
    defined = {
        value
        for key, value in vars(names).items()
        if key.isupper() and isinstance(value, str) and "/" in value and not value.endswith("/")
    }
    listed = table_names(page)
    assert len(listed) == len(set(listed)) and set(listed) == defined
    assert defined >= {*names.ALL, *names.WITH_PEAK, *names.PADDING, *names.THROUGHPUT}
    # each with the comment it is defined with, and its unit from its name
    assert "| `flops_profiler/iter_latency` | s | fwd + bwd + step latency |" in page
    assert "| `flops_profiler/flops_per_sec` | flop/s | (fwd + bwd flops) / iter latency |" in page


def test_the_window_numbers_on_the_pages_are_the_window_plans() -> None:
    from flops_callbacks.session.window_plan import MODULE_TIMING_STEPS, before_clean

    before = before_clean()
    page = hooks().on_page_markdown((DOCS / "how-it-works.md").read_text())
    assert "{{" not in page
    assert f"**the {MODULE_TIMING_STEPS} module-timing steps**" in page
    assert f"`profile_step + {before} + clean_steps`" in page


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
    assert set(hooks().option_descriptions()) == set(options)


def test_the_readme_is_a_landing_page_with_the_docs_sample_console() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert readme.index("python3 tasks.py demo") < readme.index("## Install")
    assert "python3 tasks.py test" in readme
    fenced = r"<!-- console: start[^\n]*-->\n```text\n(.*?)```\n<!-- console: end -->"
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
