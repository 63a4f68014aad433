"""A profiled generation saved as JSON, read back whole, and shown again by the command line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from flops_callbacks import profile_generation
from flops_callbacks.cli import main
from flops_callbacks.generation.json_file import generation_from_json, read_generation
from flops_callbacks.reporting.profile_file import ProfileFileError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def generation() -> object:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(3, 64, (2, 8))
    return profile_generation(
        model, input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, runs=1, warm_up=0,
        peak_flops=1e12, peak_bandwidth=1e11,
    )  # fmt: skip


def test_the_json_reads_back_as_the_same_result(generation, tmp_path: Path) -> None:
    path = generation.save(tmp_path / "generation.json")
    data = json.loads(path.read_text())
    assert data["schema"] == "flops_callbacks.generation"
    assert data["metrics"] == generation.metrics
    assert generation_from_json(data) == generation.result
    assert read_generation(path) == generation.result


def test_show_prints_the_report_again_and_draws_the_picture(generation, tmp_path: Path) -> None:
    path = generation.save(tmp_path / "generation.json")
    out = io.StringIO()
    assert main(["show", str(path), "--html", str(tmp_path / "g.html")], out=out) == 0
    assert out.getvalue() == generation.report + "\n"
    page = (tmp_path / "g.html").read_text()
    assert "flops_callbacks generation profile: a decode step" in page and "decode mbu" in page


def test_a_window_file_is_not_taken_for_a_generation_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    window = tmp_path / "window.json"
    window.write_text(json.dumps({"schema": "flops_callbacks.profile", "schema_version": 1}))
    assert read_generation(window) is None
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema": "flops_callbacks.generation", "schema_version": 99}))
    with pytest.raises(ProfileFileError, match="version 99 is unknown"):
        read_generation(newer)
    assert main(["show", str(newer)], out=io.StringIO()) == 2


def test_diff_and_gate_refuse_a_generation_and_say_what_reads_it(generation, tmp_path: Path, capsys) -> None:
    path = str(generation.save(tmp_path / "generation.json"))
    assert main(["diff", path, path], out=io.StringIO()) == 2
    assert main(["gate", path, path, "--fail-on", "iter_latency:+5%"], out=io.StringIO()) == 2
    assert "a generation's profile: diff and gate compare training windows; show prints it" in (
        capsys.readouterr().err
    )
