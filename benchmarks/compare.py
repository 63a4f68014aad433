"""Forward and forward+backward flops of real architectures, as ratios to the aten reference, for
flops_callbacks and the tools users compare it with (those that are installed).

Reference: torch's ``FlopCounterMode`` with SDPA on the math backend (attention becomes matmuls it
counts), i.e. matmul, convolution and attention flops of the real forward and the real backward;
for RNNs, whose kernels it counts as 0, the standard formula (``rnn_flops`` below,
backward = 2 x forward). Every tool runs on CPU on its own copy of the same model (same weights,
same ``requires_grad`` flags) with the same input tensors, so a tool that leaves hooks, patches or
a changed ``train()`` flag behind cannot affect the next one; what each left behind is listed.
A tool that fails gets "error: <reason>" in its cells; one that is not importable, "not installed".
Not the meta device: there SDPA always runs the math kernel, which would hide what FlopCounterMode
misses on a real device; full-size configs with short inputs keep the run to about two minutes.

Why the others differ: DeepSpeed patches ``torch.nn.functional``, so it sees attention whatever kernel
runs, but measures no backward (its forward + backward, like calflops', fvcore's and ptflops', is
3 x forward); calflops and ptflops patch neither ``F.scaled_dot_product_attention`` nor
``Tensor.__matmul__``; fvcore traces with ``torch.jit``. Left behind on torch 2.13: ptflops leaves five
attributes on the model, and both it and calflops leave the model in ``eval()``.

    DS_BUILD_OPS=0 pip install "flops-callbacks[bench]"    # the other tools (optional)
    python benchmarks/compare.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.metadata
import importlib.util
import io
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from flops_callbacks import FlopsProfiler

Inputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Count:
    """Flops of one forward and of one forward + backward (as measured, or as the tool estimates it)."""

    fwd: int
    fwd_bwd: int


# --- the models: real architectures from transformers configs, an LSTM, a functional-only block ----


def rnn_flops(
    mode: str,
    input_size: int,
    hidden_size: int,
    tokens: int,
    num_layers: int = 1,
    bidirectional: bool = False,
) -> int:
    """The standard forward formula for ``nn.RNN``/``GRU``/``LSTM`` matmul flops (no gate arithmetic):
    the reference for RNNs, whose kernels FlopCounterMode counts as 0 on CPU."""
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[mode]
    directions = 2 if bidirectional else 1
    total = 0
    for layer in range(num_layers):
        layer_in = input_size if layer == 0 else hidden_size * directions
        total += directions * 2 * tokens * gates * hidden_size * (layer_in + hidden_size)
    return total


def transformers_module() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()  # config notes on every build would drown the tables
    return transformers


def tokens(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def bert_base(small: bool) -> tuple[nn.Module, Inputs]:
    tf = transformers_module()
    config = tf.BertConfig(**(dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=512) if small else {}))  # fmt: skip
    x = tokens(1, 128, config.vocab_size)
    return tf.BertModel(config), {"input_ids": x}  # with the pooler


def gpt2_config(small: bool) -> Any:
    tf = transformers_module()
    if not small:
        return tf.GPT2Config()  # 124M
    config = tf.GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=2048, n_positions=128)
    config.bos_token_id = config.eos_token_id = 0
    return config


def gpt2(small: bool) -> tuple[nn.Module, Inputs]:
    config = gpt2_config(small)
    x = tokens(1, 128, config.vocab_size)
    return transformers_module().GPT2LMHeadModel(config), {"input_ids": x, "labels": x}


def gpt2_last_block_trainable(small: bool) -> tuple[nn.Module, Inputs]:
    """Fine-tuning: every parameter frozen but the last block's (the tied embedding/head included)."""
    model, inputs = gpt2(small)
    model.requires_grad_(False)
    model.transformer.h[-1].requires_grad_(True)
    return model, inputs


def llama_gqa(small: bool) -> tuple[nn.Module, Inputs]:
    tf = transformers_module()
    config = tf.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=4,  # grouped-query attention; RoPE and RMSNorm are Llama's own code
        vocab_size=32000,
    )
    x = tokens(2, 128, config.vocab_size)
    return tf.LlamaForCausalLM(config), {"input_ids": x, "labels": x}


def vit_base(small: bool) -> tuple[nn.Module, Inputs]:
    tf = transformers_module()
    model = tf.ViTForImageClassification(tf.ViTConfig(num_labels=1000))
    return model, {"pixel_values": torch.randn(1, 3, 224, 224), "labels": torch.tensor([3])}


def resnet50(small: bool) -> tuple[nn.Module, Inputs]:
    tf = transformers_module()
    model = tf.ResNetForImageClassification(tf.ResNetConfig(num_labels=1000))  # defaults: ResNet-50
    return model, {"pixel_values": torch.randn(1, 3, 224, 224), "labels": torch.tensor([3])}


def t5_small(small: bool) -> tuple[nn.Module, Inputs]:
    tf = transformers_module()
    config = tf.T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128)
    config.decoder_start_token_id = config.pad_token_id = 0
    x = tokens(1, 64, config.vocab_size)
    return tf.T5ForConditionalGeneration(config), {"input_ids": x, "labels": x}


class LstmLM(nn.Module):
    """Embedding, a 2-layer LSTM and a vocabulary head: the RNN kernel FlopCounterMode counts as 0."""

    def __init__(self, vocab: int = 1000, width: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def lstm_lm(small: bool) -> tuple[nn.Module, Inputs]:
    return LstmLM(), {"tokens": tokens(32, 16, 1000)}


class FunctionalBlock(nn.Module):
    """A transformer block written only with F.linear, torch.einsum, @ and F.scaled_dot_product_attention:
    no nn.Linear for module-hook tools to find."""

    def __init__(self, width: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Parameter(torch.randn(3 * width, width) / width**0.5)
        self.proj = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.up = nn.Parameter(torch.randn(width, 4 * width) / width**0.5)
        self.down = nn.Parameter(torch.randn(4 * width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            nn.functional.linear(x, self.qkv)
            .view(b, t, 3, self.heads, d // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.einsum("bhtd,hde->bte", attended, self.proj.view(self.heads, d // self.heads, d))
        return x + torch.relu(x @ self.up) @ self.down


def functional_block(small: bool) -> tuple[nn.Module, Inputs]:
    return FunctionalBlock(), {"x": torch.randn(2, 64, 256)}


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[bool], tuple[nn.Module, Inputs]]  # argument: small (the --quick sizes)
    quick_name: str | None = None  # its name in the --quick subset (None: not in it)
    training: bool = True  # train() (dropout on: CPU attention then runs the math kernel) or eval()


CASES = [
    Case("BERT-base, seq 128", bert_base),
    Case("GPT-2 124M, seq 128", gpt2, "GPT-2 (4 x 128 wide), seq 128"),
    Case("GPT-2 124M, seq 128, eval() (fused CPU attention)", gpt2, training=False),
    Case("Llama (GQA, 2 layers), 2x128", llama_gqa),
    Case("ViT-base, 224px", vit_base),
    Case("ResNet-50, 224px", resnet50),
    Case("T5-small, seq 64", t5_small),
    Case("LSTM LM (2x256), 32x16", lstm_lm, "LSTM LM (2x256), 32x16"),
    Case("functional block (einsum, @, SDPA)", functional_block, "functional block (einsum, @, SDPA)"),
    Case(
        "GPT-2 124M fine-tune, last block trainable",
        gpt2_last_block_trainable,
        "GPT-2 (4 x 128 wide) fine-tune, last block trainable",
    ),
]


# --- the reference -------------------------------------------------------------------------------


def loss_of(output: Any) -> torch.Tensor:
    """The model's own loss when it has one, else the sum of its (first) output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensor = output if isinstance(output, torch.Tensor) else output[0]
    return tensor.float().sum()


def reference(model: nn.Module, inputs: Inputs) -> Count:
    """FlopCounterMode (math SDPA) of the real forward and backward; RNN modules by the formula."""
    rnn_tokens: dict[str, int] = {}
    rnns = {name: m for name, m in model.named_modules() if isinstance(m, nn.RNNBase)}

    def record(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            rnn_tokens[name] = args[0].numel() // args[0].shape[-1]

        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in rnns.items()]
    try:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            output = model(**inputs)
            fwd, fwd_rnn = counter.get_total_flops(), counted_in(counter, model, rnns)
            loss_of(output).backward()
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    formula = sum(
        rnn_flops(m.mode, m.input_size, m.hidden_size, rnn_tokens[name], m.num_layers, m.bidirectional)
        for name, m in rnns.items()
    )
    fwd_bwd, fwd_bwd_rnn = counter.get_total_flops(), counted_in(counter, model, rnns)
    return Count(fwd - fwd_rnn + formula, fwd_bwd - fwd_bwd_rnn + 3 * formula)


def counted_in(counter: FlopCounterMode, model: nn.Module, modules: dict[str, nn.Module]) -> int:
    """What FlopCounterMode booked under ``modules`` (its names: "<RootClass>.<path>")."""
    counts = counter.get_flop_counts()
    root = type(model).__name__
    return sum(sum(counts.get(f"{root}.{name}", {}).values()) for name in modules)


# --- the tools -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One tool: the columns it fills and how to measure them on (a copy of) a model."""

    columns: tuple[str, ...]
    module: str | None  # the import that must succeed, or None (always there)
    measure: Callable[[nn.Module, Inputs], tuple[Count, ...]]  # one Count per column
    distribution: str | None = None  # for the version line


def ours(model: nn.Module, inputs: Inputs) -> tuple[Count, Count]:
    prof = FlopsProfiler(model)
    prof.start_profile()
    try:
        loss_of(model(**inputs)).backward()
    finally:
        prof.stop_profile()
    profile = prof.get_profile()
    prof.end_profile()
    dense = Count(2 * profile.fwd_macs, 2 * (profile.fwd_macs + profile.bwd_macs))
    return dense, Count(profile.fwd_flops, profile.model_flops)


def flop_counter_mode(model: nn.Module, inputs: Inputs) -> tuple[Count]:
    """What users get: the device's default SDPA kernel (on CPU, one FlopCounterMode has no formula for)."""
    with FlopCounterMode(display=False) as counter:
        output = model(**inputs)
        fwd = counter.get_total_flops()
        loss_of(output).backward()
    return (Count(fwd, counter.get_total_flops()),)


def three_times(fwd: int) -> Count:
    """Forward-only tools' training step as they (or their users) estimate it: backward = 2 x forward."""
    return Count(fwd, 3 * fwd)


def deepspeed(model: nn.Module, inputs: Inputs) -> tuple[Count]:
    from deepspeed.profiling.flops_profiler import FlopsProfiler as DeepSpeedProfiler

    prof = DeepSpeedProfiler(model)
    prof.start_profile()
    try:
        model(**inputs)
        flops = prof.get_total_flops()
    finally:
        prof.end_profile()
    return (three_times(flops),)  # DeepSpeed's report: "bwd flops = 2 * fwd flops"


def calflops(model: nn.Module, inputs: Inputs) -> tuple[Count]:
    from calflops import calculate_flops

    flops, _, _ = calculate_flops(model, kwargs=dict(inputs), print_results=False, output_as_string=False)
    # include_backPropagation=True multiplies by 1 + compute_bp_factor (default 2): the same 3x.
    return (three_times(int(flops)),)


class KeywordAdapter(nn.Module):
    """Positional inputs for tracing tools, and one tensor out (the loss when the model computes one)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        output = self.model(**dict(zip(self.names, args, strict=True)))
        loss = getattr(output, "loss", None)
        return loss if isinstance(loss, torch.Tensor) else loss_of(output)


def fvcore(model: nn.Module, inputs: Inputs) -> tuple[Count]:
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(KeywordAdapter(model, list(inputs)), tuple(inputs.values()))
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    return (three_times(2 * int(analysis.total())),)  # fvcore's "flop" is a multiply-accumulate


def ptflops(model: nn.Module, inputs: Inputs) -> tuple[Count]:
    from ptflops import get_model_complexity_info

    out = io.StringIO()
    macs, _ = get_model_complexity_info(
        model, (1,), input_constructor=lambda _: dict(inputs), as_strings=False,
        print_per_layer_stat=False, ost=out,
    )  # fmt: skip
    if macs is None:  # ptflops catches the exception, prints it and returns None
        raise RuntimeError(out.getvalue().strip().splitlines()[-1] if out.getvalue().strip() else "failed")
    return (three_times(2 * int(macs)),)  # ptflops reports MACs


TOOLS = [
    Tool(("flops_callbacks, matmul", "flops_callbacks, all"), None, ours, "flops-callbacks"),
    Tool(("DeepSpeed †",), "deepspeed.profiling.flops_profiler", deepspeed, "deepspeed"),
    Tool(("calflops †",), "calflops", calflops, "calflops"),
    Tool(("fvcore (MACs x2) †",), "fvcore.nn", fvcore, "fvcore"),
    Tool(("ptflops (MACs x2) †",), "ptflops", ptflops, "ptflops"),
    Tool(("FlopCounterMode (default SDPA)",), None, flop_counter_mode),
]


def import_error(tool: Tool) -> str | None:
    """None when the tool can run, else the text for its cells."""
    if tool.module is None:
        return None
    if importlib.util.find_spec(tool.module.split(".")[0]) is None:
        return "not installed"
    try:  # DeepSpeed prints accelerator notes on import
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            importlib.import_module(tool.module)
    except Exception as exc:  # a broken install is reported in the cells, not fatal
        return f"error: import {short(exc)}"
    return None


def short(exc: BaseException) -> str:
    """One table-safe line: the exception's type and the last line of its message, cut at 70 characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}".strip().rstrip(":").replace("|", "/")
    return (text[:70] + "...") if len(text) > 73 else text


def run_tool(tool: Tool, model: nn.Module, inputs: Inputs, left: set[str]) -> tuple[Count, ...] | str:
    """The tool's counts on its own copy of ``model``, or "error: <short reason>". What the tool left
    behind on the copy or in torch is added to ``left``."""
    own = copy.deepcopy(model)
    before, functions = model_state(own), torch_functions()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            return tool.measure(own, inputs)
    except Exception as exc:  # one tool failing must not lose the table
        return f"error: {short(exc)}"
    finally:
        left.update(changes(before, model_state(own)))
        left.update(
            f"{name} still replaced" for name, f in torch_functions().items() if f is not functions[name]
        )


def model_state(model: nn.Module) -> dict[str, Any]:
    """What a profiler might leave on a model: train() flags, hooks, instance attributes."""
    modules = list(model.modules())
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    global_hooks = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)
    return {
        "training": [m.training for m in modules],
        "hooks": sum(len(getattr(m, h)) for m in modules for h in hooks) + sum(map(len, global_hooks)),
        "attributes": {name for m in modules for name in vars(m)},
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    if after["training"] != before["training"]:
        found.append("model left in eval()" if not any(after["training"]) else "train() flags changed")
    if after["hooks"] != before["hooks"]:
        found.append(f"{after['hooks'] - before['hooks']:+d} hooks")
    if added := sorted(after["attributes"] - before["attributes"]):
        found.append("attributes added: " + ", ".join(added))
    return found


def torch_functions() -> dict[str, Any]:
    """The torch functions profilers monkey-patch, as looked up now."""
    functional, tensor = nn.functional, torch.Tensor
    return {
        "F.linear": functional.linear,
        "F.scaled_dot_product_attention": functional.scaled_dot_product_attention,
        "F.softmax": functional.softmax,
        "F.layer_norm": functional.layer_norm,
        "F.gelu": functional.gelu,
        "F.relu": functional.relu,
        "F.conv2d": functional.conv2d,
        "torch.matmul": torch.matmul,
        "torch.addmm": torch.addmm,
        "torch.bmm": torch.bmm,
        "torch.einsum": torch.einsum,
        "Tensor.__matmul__": tensor.__matmul__,
        "Tensor.add": tensor.add,
        "Tensor.mul": tensor.mul,
    }


# --- the table -----------------------------------------------------------------------------------


def cell(value: int, truth: int) -> str:
    if value == truth:
        return "1 (exact)"
    return f"{value / truth:.3f}"


def versions() -> str:
    parts = [f"torch {torch.__version__}"]
    for tool in TOOLS:
        if tool.distribution and import_error(tool) is None:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                parts.append(f"{tool.distribution} {importlib.metadata.version(tool.distribution)}")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small subset with small configs (< 60 s)")
    args = parser.parse_args()
    torch.manual_seed(0)
    started = time.perf_counter()

    unavailable = {id(tool): import_error(tool) for tool in TOOLS}
    left: dict[int, set[str]] = {id(tool): set() for tool in TOOLS}
    columns = [c for tool in TOOLS for c in tool.columns]
    fwd_rows: list[list[str]] = []
    fwd_bwd_rows: list[list[str]] = []
    for case in [c for c in CASES if c.quick_name or not args.quick]:
        name = case.quick_name if args.quick else case.name
        model, inputs = case.build(args.quick)
        model.train(case.training)
        truth = reference(model, inputs)
        fwd_row = [name, f"{truth.fwd / 1e9:.2f}"]
        fwd_bwd_row = [name, f"{truth.fwd_bwd / 1e9:.2f}"]
        for tool in TOOLS:
            result = unavailable[id(tool)] or run_tool(tool, model, inputs, left[id(tool)])
            for i in range(len(tool.columns)):
                if isinstance(result, str):
                    fwd_row.append(result)
                    fwd_bwd_row.append(result)
                else:
                    fwd_row.append(cell(result[i].fwd, truth.fwd))
                    fwd_bwd_row.append(cell(result[i].fwd_bwd, truth.fwd_bwd))
        fwd_rows.append(fwd_row)
        fwd_bwd_rows.append(fwd_bwd_row)
        del model

    print(f"Flops as a ratio to the aten reference; CPU, {versions()}{', --quick' if args.quick else ''}")
    print()
    print_table("Forward", "reference GFLOPs", columns, fwd_rows)
    print()
    print_table("Forward + backward (one training step)", "reference GFLOPs", columns, fwd_bwd_rows)
    print()
    print(FOOTNOTES)
    print()
    print("### Left behind after profiling (on the tool's copy of the model, or in torch)")
    print()
    print("| tool | changes found after its runs |")
    print("|---|---|")
    for tool in TOOLS:
        found = unavailable[id(tool)] or "; ".join(sorted(left[id(tool)])) or "nothing"
        print(f"| {tool.columns[0].split(',')[0].rstrip(' †')} | {found} |")
    print()
    print(f"({time.perf_counter() - started:.0f} s)")


def print_table(title: str, reference_column: str, columns: list[str], rows: list[list[str]]) -> None:
    print(f"### {title}")
    print()
    print("| model | " + " | ".join([reference_column, *columns]) + " |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for row in rows:
        print("| " + " | ".join(row) + " |")


FOOTNOTES = """\
Reference: FlopCounterMode with SDPA on the math backend (matmul, convolution and attention flops of
the real forward and backward); for the LSTM, the standard formula 2 x tokens x (W_ih + W_hh) per
layer, backward = 2 x forward. "flops_callbacks, matmul" is 2 x its MACs (the same ops the reference
counts); "all" adds elementwise work (norms, activations, softmax, losses, ...).
† forward only: forward + backward is the tool's (or its users') estimate, backward = 2 x forward
(DeepSpeed's report, calflops' include_backPropagation=True); it ignores frozen parameters.
MACs x2: the tool reports multiply-accumulates (elementwise ops included as counted); shown x2."""


if __name__ == "__main__":
    main()
