"""The picture of a profile: a real GPT-2 profile rendered to HTML, opened in headless Chromium.

Chromium runs the page's script (``--dump-dom`` gives the DOM after it ran) and paints it
(``--screenshot``): the module tree, the numbers formatted as the text report formats them, and a
chart drawn in the colour ramp. The page's embedded data is read back and compared with the profile.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path

import pytest
import torch

from flops_callbacks.cli import main
from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.profile import Profile
from flops_callbacks.reporting.picture import render_html
from flops_callbacks.roofline import as_data, module_rooflines
from flops_callbacks.units import duration_to_string, macs_to_string, number_to_string, params_to_string

transformers = pytest.importorskip("transformers")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install -y chromium)"
)
TEMPLATE = files("flops_callbacks.reporting").joinpath("picture.html").read_text(encoding="utf-8")
RAMP = {  # the page's colour ramp (viridis), as RGB
    tuple(int(c[i : i + 2], 16) for i in (1, 3, 5))
    for c in re.findall(r'"(#[0-9a-f]{6})"', TEMPLATE.split("RAMP = [")[1].split("]")[0])
}
WINDOW = (1200, 800)


@pytest.fixture(scope="module")
def profile() -> Profile:
    """One training step of a 2-layer GPT-2, counted and timed by the CountingEngine."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (2, 16))
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        tracer.stop()
    return tracer.profile()


@pytest.fixture(scope="module")
def page(profile: Profile, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("picture") / "profile.html"
    summary = [("model", "GPT-2, 2 layers"), ("fwd latency", duration_to_string(profile.fwd_latency))]
    path.write_text(render_html(profile, title="GPT-2 <2 layers>", headline=summary))
    return path


def chromium(*args: str, tmp: Path, window: tuple[int, int] = WINDOW) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp / 'chromium-profile'}", f"--window-size={window[0]},{window[1]}", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def dom_after(page: Path, script: str, tmp: Path) -> str:
    """``page``'s DOM once Chromium ran it with ``script`` run after its own, at the body's end."""
    ran = tmp / f"ran-{page.name}"
    ran.write_text(page.read_text().replace("</body>", f"<script>{script}</script></body>"))
    return chromium("--dump-dom", ran.as_uri(), tmp=tmp).stdout


def embedded_data(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="profile-data">(.*?)</script>', html)[1])


def read_png(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and RGB rows of an 8-bit non-interlaced RGB or RGBA PNG (what Chromium writes)."""
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(blob):
        length, kind = struct.unpack(">I4s", blob[pos : pos + 8])
        body = blob[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert (depth, colour, interlace) in ((8, 2, 0), (8, 6, 0))
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    step = 3 if colour == 2 else 4
    raw, stride, rows, prev = zlib.decompress(idat), width * step, [], bytearray(width * step)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up, corner = prev[i], prev[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append(bytes(b for x in range(width) for b in line[x * step : x * step + 3]))
        prev = line
    return width, height, rows


def test_the_page_embeds_every_module_with_its_counts_and_children(profile: Profile, page: Path) -> None:
    modules = embedded_data(page.read_text())["modules"]
    # the model, the transformer and its 5 children, 2 blocks of 13 modules, lm_head
    assert len(modules) == len(profile.modules) == 34
    names = [m["name"] for m in modules]
    assert names[0] == "" and set(names) == set(profile.modules)
    for record in modules:
        expected = asdict(profile.modules[record["name"]])
        assert {k: v for k, v in record.items() if k not in ("kids", "doubt")} == expected
        assert record["doubt"] == ""  # no doubts were given
        assert [names[k] for k in record["kids"]] == [c.name for c in profile.children(record["name"])]
    # depth first: every module comes right after its previous sibling's subtree, under its parent
    assert names[:5] == ["", "transformer", "transformer.wte", "transformer.wpe", "transformer.drop"]
    assert names[-1] == "lm_head"


def test_the_page_fetches_nothing_and_escapes_what_it_is_given(page: Path) -> None:
    html = page.read_text()
    assert not re.search(r"https?:|//[a-z0-9]|\b(src|href)\s*=|@import|url\(", html, re.IGNORECASE)
    assert "<title>GPT-2 &lt;2 layers&gt;</title>" in html
    assert "<dt>model</dt><dd>GPT-2, 2 layers</dd>" in html


def test_a_module_name_cannot_close_the_script_that_holds_the_data() -> None:
    evil = "x</script><script>alert(1)</script>"
    model = torch.nn.Sequential()
    model.add_module(evil, torch.nn.Linear(2, 3))
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(torch.ones(1, 2))
    finally:
        tracer.stop()
    html = render_html(tracer.profile())
    assert html.count("</script>") == 2  # the data's and the code's, nothing else
    modules = embedded_data(html)["modules"]
    assert [m["name"] for m in modules] == ["", evil] and modules[1]["fwd_macs"] == 6


@needs_chromium
def test_chromium_runs_the_script_and_the_page_shows_names_and_numbers(
    profile: Profile, page: Path, tmp_path: Path
) -> None:
    dom = chromium("--dump-dom", page.as_uri(), tmp=tmp_path).stdout
    assert f'data-rendered="{len(profile.modules)}"' in dom  # the script ran to its end
    for name in profile.modules:
        assert f'data-name="{name}"' in dom
    assert len(re.findall(r'<div class="cell[^"]*" data-name=', dom)) == len(profile.modules)
    # the details of the model, formatted as the text report formats them
    root = profile.model
    details = dom.split('id="details"')[1].split('id="tip"')[0]
    for text in (
        number_to_string(root.fwd_flops).strip(),
        number_to_string(root.bwd_flops).strip(),
        macs_to_string(root.fwd_macs),
        duration_to_string(root.fwd_latency),
        *root.functionals,
    ):
        assert f">{text}<" in details, text
    assert re.search(f"(>|· ){re.escape(params_to_string(root.params))} params \\(", details)
    # the transformer's bar (nearly all of the forward) is wide enough to carry its full label
    label = f"transformer GPT2Model · {duration_to_string(profile.modules['transformer'].fwd_latency)}"
    assert re.search(f'data-name="transformer"[^>]*>{re.escape(label)}<', dom)


@needs_chromium
def test_the_screenshot_shows_the_chart_in_the_colour_ramp(page: Path, tmp_path: Path) -> None:
    png = tmp_path / "shot.png"
    chromium(f"--screenshot={png}", page.as_uri(), tmp=tmp_path)
    width, height, rows = read_png(png)
    assert (width, height) == WINDOW
    pixels = [row[i : i + 3] for row in rows for i in range(0, len(row), 3)]
    colours = {tuple(p) for p in pixels}
    assert len(colours) > 50  # text, panels and bars, not one flat colour
    in_ramp = sum(1 for p in pixels if tuple(p) in RAMP)
    assert in_ramp > 0.03 * width * height  # the bars: at least a few percent of the window
    assert len(RAMP & colours) >= 3  # modules of different achieved FLOPS in different colours


@needs_chromium
def test_a_click_zooms_into_a_module_and_the_toggle_shows_backward_latency(
    profile: Profile, page: Path, tmp_path: Path
) -> None:
    clicks = (
        "document.querySelector('[data-name=\"transformer.h.1\"]').click();"
        "document.querySelector('[data-phase=\"bwd\"]').click();"
    )
    dom = dom_after(page, clicks, tmp_path)

    def style(name: str) -> str:
        return re.search(f'data-name="{re.escape(name)}" style="([^"]*)"', dom)[1]

    block = profile.modules["transformer.h.1"]
    # the block and its ancestors span the width; its children share it; the other block is hidden
    for name in ("", "transformer", "transformer.h", "transformer.h.1"):
        assert "left: 0%; width: 100%" in style(name)
    assert "display: none" in style("transformer.h.0") and "display: none" in style("lm_head")
    shown = 0
    for child in profile.children(block.name):
        share = child.bwd_latency / block.bwd_latency
        if "display: none" in style(child.name):
            assert share < 1 / WINDOW[0]  # hidden only when thinner than half a pixel of the chart
        else:
            shown += 1
            width = float(re.search(r"width: ([0-9.e-]+)%", style(child.name))[1])
            assert width / 100 == pytest.approx(share, abs=1e-5)  # Chromium keeps 6 digits
    assert shown  # the widest of ln_1, attn, ln_2, mlp at least
    # the details follow the zoom, in the phase shown
    details = dom.split('id="details"')[1].split('id="tip"')[0]
    assert ">transformer.h.1<small>GPT2Block</small>" in details
    assert f">{duration_to_string(block.bwd_latency)}<" in details
    assert '<span id="legend-title">achieved backward FLOPS</span>' in dom
    assert "<b>h.1</b>" in dom.split('id="crumbs"')[1].split("</div>")[0]


# --- the roofline chart -------------------------------------------------------------------------------

PEAK_FLOPS, PEAK_BANDWIDTH = 1e11, 1e10  # ridge at 10 flops per byte
MEMORY_ROOF, COMPUTE_ROOF = (0xE0, 0x7A, 0x1F), (0x24, 0x56, 0xC9)  # the page's colours of the two roofs


@pytest.fixture(scope="module")
def roofline_page(profile: Profile, tmp_path_factory: pytest.TempPathFactory) -> Path:
    roofline = {
        "peak_flops": PEAK_FLOPS,
        "peak_bandwidth": PEAK_BANDWIDTH,
        "peak_source": "given",
        "bandwidth_source": "given",
        "modules": as_data(module_rooflines(profile, PEAK_FLOPS, PEAK_BANDWIDTH)),
    }
    path = tmp_path_factory.mktemp("roofline") / "profile.html"
    path.write_text(render_html(profile, title="GPT-2 roofline", roofline=roofline))
    return path


def plotted(profile: Profile, phase: str = "fwd") -> dict[str, float]:
    """The modules the chart must show (a roofline with bytes and flops), with their latencies."""
    rooflines = module_rooflines(profile, PEAK_FLOPS, PEAK_BANDWIDTH)
    return {
        name: r[phase].seconds
        for name, r in rooflines.items()
        if phase in r and r[phase].intensity and r[phase].flops_per_sec > 0
    }


def attributes(tag: str) -> dict[str, str]:
    return dict(re.findall(r'([\w-]+)="([^"]*)"', tag))


@needs_chromium
def test_the_roofline_chart_plots_every_module_of_the_tree_under_two_roofs(
    profile: Profile, roofline_page: Path, tmp_path: Path
) -> None:
    dom = chromium("--dump-dom", roofline_page.as_uri(), tmp=tmp_path).stdout
    chart = dom.split('id="roofline-chart"')[1].split("</svg>")[0]
    points = [attributes(tag) for tag in re.findall(r"<circle [^>]*>", chart)]
    names = [p["data-name"] for p in points]
    expected = plotted(profile)
    assert len(expected) > 10  # the leaves that do work and their ancestors
    assert all(name in profile.modules for name in names)  # every point is a module of the tree
    assert sorted(names) == sorted(expected)  # and every module with a roofline is a point, once
    # sized by time: a longer module is never drawn smaller
    by_time = sorted(points, key=lambda p: expected[p["data-name"]])
    radii = [float(p["r"]) for p in by_time]
    assert radii == sorted(radii) and radii[-1] > radii[0]
    # the memory roof rises to the ridge, where the flat compute roof starts
    memory, compute = (
        attributes(re.search(f'<line [^>]*data-roof="{r}"[^>]*>', chart)[0]) for r in ("memory", "compute")
    )
    assert float(memory["y1"]) > float(memory["y2"])  # SVG y grows downwards: the roof rises
    assert (memory["x2"], memory["y2"]) == (compute["x1"], compute["y1"]) and compute["y1"] == compute["y2"]
    assert "ridge at 10 flops/B" in dom


@needs_chromium
def test_a_click_on_a_point_zooms_the_tree_to_that_module(roofline_page: Path, tmp_path: Path) -> None:
    click = (
        "document.querySelector('#roofline circle[data-name=\\\"transformer.h.1.mlp\\\"]')"
        ".dispatchEvent(new MouseEvent('click'));"
    )
    dom = dom_after(roofline_page, click, tmp_path)
    style = re.search('data-name="transformer.h.1.mlp" style="([^"]*)"', dom)[1]
    assert "left: 0%; width: 100%" in style  # the icicle zoomed to it
    assert "<b>mlp</b>" in dom.split('id="crumbs"')[1].split("</div>")[0]
    # the point of the zoomed module and its children stay solid, the others fade
    chart = dom.split('id="roofline-chart"')[1].split("</svg>")[0]
    for tag in re.findall(r"<circle [^>]*>", chart):
        point = attributes(tag)
        inside = point["data-name"].startswith("transformer.h.1.mlp")
        assert ("faded" in point["class"]) != inside, point["data-name"]


@needs_chromium
def test_the_screenshot_shows_both_roofs(roofline_page: Path, tmp_path: Path) -> None:
    png = tmp_path / "roofline.png"
    window = (1200, 1400)  # the roofline sits under the tree
    chromium(f"--screenshot={png}", roofline_page.as_uri(), tmp=tmp_path, window=window)
    width, height, rows = read_png(png)
    assert (width, height) == window
    pixels = [tuple(row[i : i + 3]) for row in rows for i in range(0, len(row), 3)]
    # each roof is a 3 px line hundreds of pixels long (points in the same colours add to it)
    assert pixels.count(MEMORY_ROOF) > 300 and pixels.count(COMPUTE_ROOF) > 300


def test_without_peaks_the_page_says_why_there_is_no_roofline(profile: Profile) -> None:
    html = render_html(profile, no_roofline="no peak bandwidth for a cpu device")
    data = embedded_data(html)
    assert data["roofline"] is None and data["no_roofline"] == "no peak bandwidth for a cpu device"


# --- the picture of a diff ----------------------------------------------------------------------------

SLOWER_RED, SAME_GREY = (0x67, 0x00, 0x1F), (0xF7, 0xF7, 0xF7)  # the ends and middle of the page's DIVERGING


@pytest.fixture
def diff_page(runs: dict[str, Path], tmp_path: Path) -> Path:
    """``flops-callbacks diff A B --html``: B (tests/saved_runs.py: A with ``slow`` slowed)."""
    page = tmp_path / "diff.html"
    assert main(["diff", str(runs["A"]), str(runs["B"]), "--html", str(page)]) == 0
    return page


@needs_chromium
def test_the_diff_page_paints_the_slowed_module_red_and_its_parents_grey(
    diff_page: Path, tmp_path: Path
) -> None:
    dom = chromium("--dump-dom", diff_page.as_uri(), tmp=tmp_path).stdout
    assert 'data-rendered="7"' in dom  # the script ran to its end: the model and its 6 modules

    def colour(name: str) -> tuple[int, ...] | None:
        """Its bar's colour; None where the bar is too narrow to draw (``slow.linear``'s few microseconds
        beside its parent's sleep: drawn or not by the run's timing)."""
        style = re.search(f'data-name="{re.escape(name)}" style="([^"]*)"', dom)[1]
        if "display: none" in style:
            return None
        return tuple(
            int(c) for c in re.search(r"background-color: rgb\((\d+), (\d+), (\d+)\)", style).groups()
        )

    # the largest change of own time takes the full colour; the model's own time did not change
    assert colour("slow") == SLOWER_RED
    assert colour("") != SLOWER_RED and colour("slow.linear") != SLOWER_RED
    assert '<span id="legend-title">own forward time against A</span>' in dom
    # every headline value whole: a change's A value and its noise verdict were cut to "(-13.1%, A…"
    measure = (
        "document.body.dataset.cut = [...document.querySelectorAll('.headline dd')]"
        ".filter(d => d.scrollWidth > d.clientWidth).length;"
    )
    dom = dom_after(diff_page, measure, tmp_path)
    assert 'data-cut="0"' in dom and ", A " in dom.split('class="headline"')[1].split("</dl>")[0]
    png = tmp_path / "diff.png"
    chromium(f"--screenshot={png}", diff_page.as_uri(), tmp=tmp_path)
    width, height, rows = read_png(png)
    pixels = [tuple(row[i : i + 3]) for row in rows for i in range(0, len(row), 3)]
    assert pixels.count(SLOWER_RED) > 0.01 * width * height  # slow's bar: most of a row of the chart
