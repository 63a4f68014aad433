"""The core imports with torch alone; the callbacks say which extra to install."""

import subprocess
import sys
import textwrap
from pathlib import Path

BLOCK_FRAMEWORKS = textwrap.dedent(
    """
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"lightning", "pytorch_lightning", "transformers", "accelerate",
                                      "tensorboard", "wandb", "mlflow"}:
                raise ImportError(f"No module named {name!r} (blocked)")
    sys.meta_path.insert(0, Block())
    """
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_FRAMEWORKS + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_core_imports_and_profiles_with_only_torch() -> None:
    result = run(
        """
        import torch, flops_callbacks
        flops, _, _ = flops_callbacks.get_model_profile(
            torch.nn.Linear(4, 2), input_shape=(3, 4), print_profile=False, as_string=False)
        assert flops == 2 * 3 * 4 * 2, flops
        assert not any(m.split(".")[0] in {"lightning", "transformers"} for m in sys.modules)
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_missing_framework_names_the_extra() -> None:
    cases = (
        ("FlopsProfilerCallback", "pip install lightning", "lightning"),
        ("HFFlopsCallback", "pip install transformers accelerate", "hf"),
    )
    for name, install, extra in cases:
        result = run(f"import flops_callbacks\nflops_callbacks.{name}")
        assert result.returncode != 0
        assert "ImportError" in result.stderr
        assert install in result.stderr and f"pip install '.[{extra}]'" in result.stderr, result.stderr


def test_a_torch_older_than_the_floor_is_said_at_import() -> None:
    # torch 2.9 lacks torch.Tag.reduction, 2.8 and older the saved-tensor hooks' stack (both tried):
    # the floor pyproject.toml declares is the one the import checks
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"torch>=2.10"' in pyproject
    result = run("import torch\ntorch.__version__ = '2.9.1+cpu'\nimport flops_callbacks")
    assert result.returncode != 0
    assert "ImportError: flops_callbacks needs torch >= 2.10, found 2.9.1+cpu" in result.stderr, result.stderr
    assert run("import torch\ntorch.__version__ = '2.10.0+cpu'\nimport flops_callbacks").returncode == 0
