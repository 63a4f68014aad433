"""FlopsProfiler / get_model_profile: DeepSpeed's API, exact totals, and nothing left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

from flops_callbacks import (
    FlopsProfiler,
    flops_to_string,
    get_model_profile,
    get_module_duration,
    get_module_flops,
    get_module_macs,
    number_to_string,
    params_to_string,
)
from flops_callbacks.integrations.callback_base import deepspeed_callback_kwargs

B, IN, HID, OUT = 4, 8, 16, 3


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, OUT))


# Hand counts for mlp() on a (B, IN) input that needs no grad.
FWD = 2 * B * IN * HID + B * HID + 2 * B * HID * OUT  # linear, relu, linear
BWD = (
    2 * B * HID * OUT  # grad input of the second linear
    + 2 * B * HID * OUT  # grad weight of the second linear
    + B * OUT  # its bias grad (a sum over the batch)
    + B * HID  # relu backward
    + 2 * B * IN * HID  # grad weight of the first linear (its input needs no grad)
    + B * HID  # its bias grad
)


def attribute_snapshot() -> dict[str, dict[str, int]]:
    """Identity of every attribute of torch, F and Tensor (read from __dict__: no bound-method copies)."""
    owners = (torch, F, torch.Tensor, torch._C.TensorBase)
    return {owner.__name__: {k: id(v) for k, v in vars(owner).items()} for owner in owners}


GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_forward_hooks_always_called",
)


def hook_state(model: nn.Module) -> list:
    """Every module's hooks and attributes, and the hooks torch runs for every module."""
    return [
        (
            name,
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._backward_hooks),
            len(m._backward_pre_hooks),
            len(m._forward_hooks_always_called),
            sorted(vars(m)),
        )
        for name, m in model.named_modules()
    ] + [(kind, len(getattr(torch.nn.modules.module, kind))) for kind in GLOBAL_HOOKS]


def train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_forward_and_backward_counts_are_exact() -> None:
    model, x = mlp(), torch.randn(B, IN)
    with FlopsProfiler(model) as prof:
        train_step(model, x)
    p = prof.get_profile()
    assert (p.fwd_flops, p.bwd_flops, p.recompute_flops) == (FWD, BWD, 0)
    assert p.fwd_macs == B * IN * HID + B * HID * OUT
    assert p.bwd_flops != 2 * p.fwd_flops  # the first layer computes no input gradient
    assert prof.get_total_flops() == FWD  # DeepSpeed's meaning: forward flops
    assert prof.get_total_macs() == p.fwd_macs
    assert prof.get_total_params() == IN * HID + HID + HID * OUT + OUT
    assert prof.get_total_duration() == pytest.approx(p.fwd_latency) and p.fwd_latency > 0
    assert p.bwd_latency > 0
    assert p.outside_model.fwd_flops == B * OUT  # the .sum() loss is not the model's
    assert prof.get_total_flops(as_string=True) == f"{round(FWD / 1000, 2):g} K"  # DeepSpeed's: no unit


def test_deepspeed_getters_agree_with_the_profile_read_before_or_after_it() -> None:
    # The getters sum the model's totals without building the per-module profile (DeepSpeed's engine
    # reads them one at a time); recompute inside the backward is not forward work.
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

    model, x = Checkpointed(), torch.randn(B, IN)
    with FlopsProfiler(model) as prof:
        y = model(x)
        during = prof.get_total_flops(), prof.get_total_macs()
        y.sum().backward()
    before = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_duration()
    p = prof.get_profile()
    # the checkpointed forward ran again in the backward, up to the last tensor the backward needs
    assert p.recompute_flops == 2 * B * IN * HID + B * HID
    assert during == before[:2] == (FWD, B * IN * HID + B * HID * OUT)
    assert before == (p.fwd_flops, p.fwd_macs, p.fwd_latency)
    assert (prof.get_total_flops(), prof.get_total_duration()) == (p.fwd_flops, p.fwd_latency)


def test_every_module_has_its_own_fwd_and_bwd_and_parents_include_children() -> None:
    model, x = mlp(), torch.randn(B, IN)
    with FlopsProfiler(model) as prof:
        train_step(model, x)
    m = prof.get_profile().modules
    assert m["0"].fwd_flops == 2 * B * IN * HID
    assert m["0"].bwd_flops == 2 * B * IN * HID + B * HID
    assert m["1"].fwd_flops == m["1"].bwd_flops == B * HID
    assert m["2"].bwd_flops == 4 * B * HID * OUT + B * OUT
    for field in ("fwd_flops", "bwd_flops", "fwd_macs", "bwd_macs"):
        assert getattr(m[""], field) == sum(getattr(m[c], field) for c in ("0", "1", "2"))
    assert m["0"].functionals["linear"].fwd_flops == 2 * B * IN * HID
    assert m["0"].functionals["linear"].calls == 1
    assert m[""].functionals["relu"].bwd_flops == B * HID
    assert [m[n].depth for n in ("", "0", "2")] == [0, 1, 1]
    assert m["2"].class_name == "Linear" and m["2"].params == HID * OUT + OUT


def test_shared_submodule_counts_once_per_call_not_per_parent() -> None:
    shared = nn.Linear(IN, IN)

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Branch(), Branch()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + self.a.inner(x)

    net, x = Net(), torch.randn(B, IN)
    one_call = 2 * B * IN * IN
    with FlopsProfiler(net) as prof:
        net(x)
    m = prof.get_profile().modules
    assert m["a.inner"].fwd_macs * 2 == 3 * one_call and m["a.inner"].calls == 3
    assert m["a"].fwd_macs * 2 == one_call and m["b"].fwd_macs * 2 == one_call
    assert m[""].fwd_macs * 2 == 3 * one_call
    assert "b.inner" not in m  # one module, one record, under its first name


def test_a_module_whose_submodules_are_called_past_it_holds_their_work_and_time() -> None:
    """``vgg.features(x)``: the backbone's forward never runs; its row held its submodule's forward time
    but no flops (DeepSpeed's sum over the tree: the submodule's), and no backward."""

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Linear(IN, IN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("called past")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = Backbone(), nn.Linear(IN, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone.features(x))

    net = Net()
    with FlopsProfiler(net) as prof:
        net(torch.randn(B, IN)).sum().backward()
    m = prof.get_profile().modules
    features, backbone = m["backbone.features"], m["backbone"]
    # the input needs no gradient: the backward is the weight's and the bias's gradients
    assert features.fwd_flops == 2 * B * IN * IN and features.bwd_flops == 2 * B * IN * IN + B * IN
    assert (backbone.fwd_flops, backbone.bwd_flops, backbone.calls) == (
        features.fwd_flops, features.bwd_flops, 0
    )  # fmt: skip
    assert (backbone.fwd_latency, backbone.bwd_latency) == (features.fwd_latency, features.bwd_latency)
    assert backbone.bwd_latency > 0
    assert get_module_flops(net.backbone) == features.fwd_flops


def test_a_module_calling_itself_is_timed_once_by_its_outermost_call() -> None:
    """Its inner calls lie inside its outer one (each level added them again: 2.3x the model's forward)."""

    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(IN, IN)

        def forward(self, x: torch.Tensor, depth: int = 3) -> torch.Tensor:
            time.sleep(0.01)
            x = self.lin(x)
            return self(x, depth - 1) if depth else x

    net = nn.Sequential(Recursive())
    with FlopsProfiler(net) as prof:
        net(torch.randn(B, IN))
    assert get_module_flops(net[0]) == 4 * 2 * B * IN * IN  # four calls of its Linear
    assert 0.04 <= get_module_duration(net[0]) <= prof.get_total_duration() < 0.06


def test_nothing_left_behind_after_stop_even_when_the_model_raises() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(OUT, OUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise RuntimeError("boom at the profiled step")

    model = nn.Sequential(mlp(), Boom())
    before_attrs, before_hooks = attribute_snapshot(), hook_state(model)
    before_keys = list(model.state_dict())
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="boom at the profiled step"):
        model(torch.randn(B, IN))
    prof.stop_profile()
    assert attribute_snapshot() == before_attrs
    assert hook_state(model) == before_hooks
    assert list(model.state_dict()) == before_keys
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    assert not torch.overrides._get_current_function_mode_stack()
    assert prof.get_profile().modules["1.lin"].fwd_macs == B * OUT * OUT  # counted until it raised
    prof.end_profile()


def test_no_autograd_node_keeps_a_tag_after_stop() -> None:
    model, x = mlp(), torch.randn(B, IN, requires_grad=True)
    with FlopsProfiler(model):
        y = model(x)
    node, seen = y.grad_fn, []
    pending = [node]
    while pending:
        n = pending.pop()
        seen.append(dict(n.metadata))
        pending.extend(nxt for nxt, _ in n.next_functions if nxt is not None)
    assert seen and all(md == {} for md in seen)


def test_profiling_the_same_step_twice_gives_identical_counts() -> None:
    model, x = mlp(), torch.randn(B, IN)
    profiles = []
    for _ in range(2):
        with FlopsProfiler(model) as prof:
            train_step(model, x)
        profiles.append(prof.get_profile())
        model.zero_grad()
    a, b = (
        {n: (m.fwd_flops, m.bwd_flops, m.fwd_macs, m.bwd_macs, m.calls) for n, m in p.modules.items()}
        for p in profiles
    )
    assert a == b


def test_outputs_and_gradients_are_bit_identical_with_and_without_profiler() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 16, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(2, 16, 32))

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        y = model(x)
        y.square().sum().backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()]

    plain_y, plain_g = run()
    with FlopsProfiler(model):
        prof_y, prof_g = run()
    assert torch.equal(plain_y, prof_y)
    assert all(torch.equal(a, b) for a, b in zip(plain_g, prof_g, strict=True))


def test_model_run_in_another_thread_is_not_counted_and_said_once() -> None:
    """The modes are the starting thread's: the model run on another thread is counted nowhere (DeepSpeed's
    patches count it); it was 0 flops without a word, it is said once."""
    model, x = mlp(), torch.randn(B, IN)
    other = mlp()
    with warnings.catch_warnings(record=True) as caught, FlopsProfiler(model) as prof:
        warnings.simplefilter("always")
        worker = threading.Thread(target=lambda: [model(x), model(x), other(x)])
        worker.start()
        worker.join()
        model(x)
    p = prof.get_profile()
    assert p.fwd_flops == FWD and p.model.calls == 1
    said = [str(w.message) for w in caught if "thread" in str(w.message)]
    assert said == [
        "flops_callbacks: the model's 'root' ran on a thread other than the one that started the profile, "
        "where nothing is counted (the counting modes are the thread's): start the profile on the thread "
        "that runs the model."
    ]


def test_modules_outside_the_profiled_model_are_not_profiled_modules() -> None:
    # The profiler's module hooks are torch's global ones: every module passes through them while a
    # profile is on, and only the profiled model's count as modules.
    model, x = mlp(), torch.randn(B, IN)
    head = nn.Linear(OUT, 5, bias=False)  # a loss head that is not part of the model
    with FlopsProfiler(model) as prof:
        head(model(x))
    p = prof.get_profile()
    assert set(p.modules) == {name for name, _ in model.named_modules()}
    assert p.fwd_flops == FWD and p.model.calls == 1
    assert p.outside_model.fwd_flops == 2 * B * OUT * 5  # the head's matmul, outside the model


def test_meta_device_counts_without_memory_or_latency() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8192, 8192), nn.GELU(), nn.Linear(8192, 8192))
        x = torch.empty(16, 8192)
    flops, macs, params = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    assert macs == 2 * 16 * 8192 * 8192
    assert flops == 2 * macs + 16 * 8192  # plus one flop per GELU output
    assert params == 2 * (8192 * 8192 + 8192)
    with FlopsProfiler(model) as prof:
        model(x)
    assert prof.get_profile().fwd_latency == 0.0


def test_get_model_profile_forward_and_training_step(capsys: pytest.CaptureFixture[str]) -> None:
    model = mlp()
    flops, macs, params = get_model_profile(model, input_shape=(B, IN), as_string=False)
    assert (flops, macs) == (FWD, B * IN * HID + B * HID * OUT)
    assert "Profile Summary at step 1" in capsys.readouterr().out
    flops, macs, _ = get_model_profile(
        model, input_shape=(B, IN), backward=True, print_profile=False, as_string=False
    )
    assert flops == FWD + BWD
    assert capsys.readouterr().out == ""
    assert all(p.grad is None for p in model.parameters())  # its backward's gradients are not left


def test_get_model_profile_mode_runs_a_named_method() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(IN, HID)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

        def encode_twice(self, x: torch.Tensor) -> torch.Tensor:
            return self(x) + self(x)

    flops, _, _ = get_model_profile(
        Encoder(), args=[torch.randn(B, IN)], mode="encode_twice", print_profile=False, as_string=False
    )
    assert flops == 2 * (2 * B * IN * HID)


def test_output_file_gets_the_report_and_stdout_stays_clean(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    model, x = mlp(), torch.randn(B, IN)
    with FlopsProfiler(model) as prof:
        train_step(model, x)
    target = tmp_path / "profile.txt"  # type: ignore[operator]
    prof.print_model_profile(profile_step=7, output_file=target)
    assert capsys.readouterr().out == ""
    text = target.read_text()
    assert "Profile Summary at step 7:" in text
    assert "Aggregated Profile per GPU" in text and "Detailed Profile per GPU" in text
    assert "Coverage" in text and "depth 1:" in text
    assert f"(2): Linear({HID * OUT + OUT} = " in text
    assert f"in_features={HID}, out_features={OUT}, bias=True)" in text  # the module's own settings


def test_module_depth_limits_the_aggregated_profile_and_the_detailed_tree_holds_every_module() -> None:
    """As DeepSpeed prints the whole model under its aggregated profile (``print(model)``), whatever
    ``module_depth`` is; the aggregated profile stops at ``module_depth`` (its innermost depth included)."""
    model = nn.Sequential(nn.Sequential(nn.Linear(IN, IN), nn.Sequential(nn.Linear(IN, IN))))
    with FlopsProfiler(model) as prof:
        model(torch.randn(B, IN))
    shallow = prof.print_model_profile(module_depth=1, output_file=None)
    deep = prof.print_model_profile(module_depth=-1, output_file=None)
    assert shallow.split("Detailed Profile")[1] == deep.split("Detailed Profile")[1]
    assert "(1): Sequential(" in shallow.split("Detailed Profile")[1]
    assert "depth 3:" in deep  # the deepest depth is reported (DeepSpeed drops it)
    assert "depth 2:" not in shallow


def test_json_round_trip_holds_every_module(tmp_path: object) -> None:
    model, x = mlp(), torch.randn(B, IN)
    with FlopsProfiler(model) as prof:
        train_step(model, x)
    data = json.loads(json.dumps(prof.get_profile().to_dict()))
    assert data["fwd_flops"] == FWD and data["bwd_flops"] == BWD
    assert data["model_flops"] == FWD + BWD
    assert set(data["modules"]) == {"", "0", "1", "2"}
    assert data["modules"]["0"]["functionals"]["linear"]["fwd_flops"] == 2 * B * IN * HID


def test_ignore_list_folds_a_module_into_its_parent() -> None:
    model, x = mlp(), torch.randn(B, IN)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.ReLU])
    model(x)
    prof.stop_profile()
    m = prof.get_profile().modules
    assert "1" not in m and m[""].fwd_flops == FWD


def test_ignore_list_ignores_a_type_itself_not_its_subclasses() -> None:
    """As DeepSpeed (``type(module) in ignore_list``): ignoring nn.Linear swallowed a subclass of it too
    (``nn.MultiheadAttention``'s out_proj, a quantized linear), its MACs read 0."""

    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4))
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.Linear])
    model(torch.ones(1, 4))
    prof.stop_profile()
    assert "0" not in prof.get_profile().modules and get_module_macs(model[1]) == 16
    prof.end_profile()


def test_ignore_list_names_a_block_that_fsdp2_sharded_by_its_own_class() -> None:
    """``fully_shard`` swaps a block's class for one made on the fly, whose bases are FSDPModule and the
    block's class: ``ignore_list=[Block]`` means it too (the exact type did not match it)."""
    from torch.distributed.fsdp import FSDPModule

    from flops_callbacks.module_tree import ModuleTree

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].__class__ = type("FSDPLinear", (FSDPModule, nn.Linear), {})  # what fully_shard makes
    assert sorted(ModuleTree(model, (nn.Linear,)).ignored) == ["0", "1"]


def test_reset_profile_zeroes_counts_and_keeps_profiling() -> None:
    model, x = mlp(), torch.randn(B, IN)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    prof.reset_profile()
    model(x)
    model(x)
    prof.stop_profile()
    assert prof.get_total_flops() == 2 * FWD
    prof.end_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_profile()


def test_causal_half_counts_the_unmasked_part_only() -> None:
    q = torch.randn(1, 2, 8, 4)

    class Sdpa(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    full = FlopsProfiler(Sdpa())
    with full:
        full.model(q)
    half = FlopsProfiler(Sdpa(), causal_attention="half")
    with half:
        half.model(q)
    qk_and_av = 2 * (2 * 1 * 2 * 8 * 8 * 4)
    assert full.get_profile().fwd_macs * 2 == qk_and_av
    assert half.get_profile().fwd_macs * 2 == qk_and_av * 36 // 64  # 1+2+...+8 of 8x8 scores


_FLAGS = ("print_profile", "detailed", "as_string", "backward")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": "not a module"}, TypeError, "model must be a torch.nn.Module"),
        ({"warm_up": -1}, ValueError, "warm_up must be an int >= 0"),
        ({"module_depth": -2}, ValueError, "module_depth must be an int >= -1"),
        ({"top_modules": 0}, ValueError, "top_modules must be an int >= 1"),
        ({"mode": "no_such_method"}, ValueError, "mode must be one of"),
        ({"args": [torch.randn(B, IN)]}, ValueError, "either input_shape or args"),
        ({"causal_attention": "quarter"}, ValueError, r"causal_attention must be one of \('full', 'half'\)"),
        # a truthy string is no yes: "no" ran a backward and printed the detailed tree
        *(({name: "no"}, ValueError, f"{name} must be True or False") for name in _FLAGS),
        ({"ignore_modules": nn.Linear}, TypeError, "ignore_modules must be None or a list of torch.nn"),
        ({"ignore_modules": ["Linear"]}, TypeError, "ignore_modules must be None or a list"),  # matched none
        ({"input_shape": 4}, ValueError, r"input_shape must be a tuple of ints > 0 such as \(2, 128\)"),
        ({"input_shape": ()}, ValueError, "input_shape must be a tuple of ints > 0"),
        ({"input_shape": None, "args": torch.randn(B, IN)}, TypeError, "args must be a list or tuple"),
        ({"input_shape": None, "kwargs": [torch.randn(B, IN)]}, TypeError, "kwargs must be a dict"),
        # these failed after the warm-up, counting and timed passes, in torch's words
        (
            {"output_file": 123},
            ValueError,
            r"output_file must be a path \(str or os.PathLike\) or None, got 123",
        ),
        (
            {"backward": True, "loss_fn": 3},
            ValueError,
            "loss_fn must be a callable taking the model's output",
        ),
        ({"loss_fn": torch.sum}, ValueError, "loss_fn is used with backward=True only"),  # was ignored
    ],
)
def test_bad_input_names_the_argument(kwargs: dict, error: type, match: str) -> None:
    model = mlp()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    call = {"model": model, "input_shape": (B, IN), "print_profile": False, **kwargs}
    with pytest.raises(error, match=match):
        get_model_profile(**call)
    assert not calls  # before any pass


def test_bad_constructor_and_report_arguments() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        FlopsProfiler(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ds_engine must be None or a DeepSpeed engine, got 'x'"):
        FlopsProfiler(mlp(), ds_engine="x")  # it failed at print_model_profile, on dp_world_size
    with pytest.raises(TypeError, match="ignore_list must be None or a list of torch.nn.Module classes"):
        FlopsProfiler(mlp()).start_profile(ignore_list=nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="causal_attention"):
        FlopsProfiler(mlp(), causal_attention="none")
    prof = FlopsProfiler(mlp())
    with prof:
        prof.model(torch.randn(B, IN))
    with pytest.raises(ValueError, match="top_modules"):
        prof.print_model_aggregated_profile(top_modules=0)
    prof.start_profile()
    try:
        with pytest.raises(ValueError, match="output_file must be a path"):
            prof.print_model_profile(output_file=123)  # type: ignore[arg-type]
    finally:
        prof.end_profile()


# --- what DeepSpeed's own profiler tests assert, on the same models, through our import ----------------


class LeNet5(nn.Module):
    """LeNet-5 on 32x32 grey images: three tanh convolutions with average pooling, two linear layers."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        conv = [nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5), nn.Conv2d(16, 120, 5)]
        self.features = nn.Sequential(
            conv[0], nn.Tanh(), nn.AvgPool2d(2), conv[1], nn.Tanh(), nn.AvgPool2d(2), conv[2], nn.Tanh()
        )
        self.classifier = nn.Sequential(nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, classes))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.classifier(torch.flatten(self.features(x), 1))
        return logits, F.softmax(logits, dim=1)


def test_lenet5_inference_counts_what_deepspeed_asserts() -> None:
    n = 1024
    flops, macs, params = get_model_profile(
        LeNet5(), input_shape=(n, 1, 32, 32), print_profile=False, top_modules=3, as_string=False
    )
    # outputs per sample: 6x28x28 -> pool 6x14x14 -> 16x10x10 -> pool 16x5x5 -> 120 -> 84 -> 10
    conv_out, conv2_out, conv3_out = 6 * 28 * 28, 16 * 10 * 10, 120
    per_sample_macs = conv_out * 25 + conv2_out * 6 * 25 + conv3_out * 16 * 25 + 120 * 84 + 84 * 10
    assert macs == n * per_sample_macs == 426516480  # DeepSpeed's test: within 5% of 426516480
    # bias adds are not counted (a convolution or matmul is 2 x MACs, as torch counts it); one flop per
    # tanh output, per pooled input element, per softmax element
    tanh = conv_out + conv2_out + conv3_out + 84
    pools = conv_out + conv2_out
    assert flops == n * (2 * per_sample_macs + tanh + pools + 10)
    assert abs(flops - 866076672) / 866076672 < 0.05  # DeepSpeed's test and tolerance
    assert params == 61706


def ulysses_engine(**overrides: object) -> SimpleNamespace:
    """A stand-in with the attributes DeepSpeed's profiler reads from its engine."""
    engine = {
        "world_size": 8,
        "dp_world_size": None,  # sequence parallelism: the data-parallel group is seq_dp's
        "seq_dp_world_size": 4,
        "mp_world_size": 1,
        "has_moe_layers": False,
        "train_micro_batch_size_per_gpu": lambda: 1,
        "wall_clock_breakdown": lambda: False,
    }
    return SimpleNamespace(**{**engine, **overrides})


def test_engine_without_dp_world_size_reports_the_sequence_data_parallel_size(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = nn.Sequential(nn.Linear(128, 128))
    prof = FlopsProfiler(model)
    prof.ds_engine = ulysses_engine()
    prof.start_profile()
    for _ in range(3):
        model(torch.randn(64, 128))
    prof.print_model_profile(profile_step=1, detailed=False)
    prof.end_profile()
    out = capsys.readouterr().out
    assert re.search(r"data parallel size:\s+(\S+)", out).group(1) == "4"  # type: ignore[union-attr]
    assert re.search(r"world size:\s+(\S+)", out).group(1) == "8"  # type: ignore[union-attr]
    assert re.search(r"batch size per GPU:\s+(\S+)", out).group(1) == "1"  # type: ignore[union-attr]
    assert "Aggregated Profile per GPU" in out and "Detailed Profile" not in out  # detailed=False


class SimpleModel(nn.Module):
    """The model of DeepSpeed's engine test: one Linear in a ModuleList, the loss inside the forward."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.cross_entropy_loss(self.linears[0](x), y)


def test_engine_style_profile_is_read_through_prof_flops_and_params(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # DeepSpeed's engine starts the profile before the forward of its profile step, stops it after,
    # and prints after the optimizer step; its test then reads prof.flops and prof.params.
    hidden = 10
    torch.manual_seed(0)
    model = SimpleModel(hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = FlopsProfiler(model, ds_engine=ulysses_engine(dp_world_size=1, world_size=1))
    for step in range(4):
        x, y = torch.randn(1, hidden), torch.randint(0, hidden, (1,))
        if step == 1:
            prof.start_profile()
        loss = model(x, y)
        if step == 1:
            prof.stop_profile()
            assert prof.started  # as DeepSpeed: until end_profile
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            prof.print_model_profile(profile_step=step, module_depth=-1, top_modules=3)
            prof.end_profile()
    # linear 2 x 100 MACs, the loss's log_softmax 10 and nll_loss 1 (DeepSpeed's test: 200 +- 5%; it
    # does not count the loss inside the model's forward)
    assert prof.flops == 2 * hidden * hidden + hidden + 1
    assert prof.macs == hidden * hidden
    assert prof.params == hidden * hidden + hidden == 110
    assert "Profile Summary at step 1:" in capsys.readouterr().out
    assert not prof.started


def test_engine_timers_give_deepspeeds_estimated_backward_rows() -> None:
    # With wall_clock_breakdown the engine's timers (milliseconds) give fwd, bwd and step latency; the
    # backward was not profiled, so its flops are DeepSpeed's estimate (2 + recompute_fwd_factor) x fwd.
    elapsed = {"fwd": 2.0, "bwd": 5.0, "step": 1.0}
    timers = lambda name: SimpleNamespace(elapsed=lambda reset=True: elapsed[name])  # noqa: E731
    engine = ulysses_engine(
        dp_world_size=2, mp_world_size=4, wall_clock_breakdown=lambda: True, timers=timers,
        train_micro_batch_size_per_gpu=lambda: 3,
    )  # fmt: skip
    model = mlp()
    prof = FlopsProfiler(model, ds_engine=engine, recompute_fwd_factor=0.5)
    prof.start_profile()
    model(torch.randn(B, IN))
    prof.stop_profile()
    text = prof.print_model_profile(output_file=os.devnull)
    rows = summary_rows(text)
    assert rows["model parallel size"] == "4" and rows["data parallel size"] == "2"
    assert rows["params of model = params per GPU * mp_size"] == params_to_string(4 * prof.params)
    assert rows["fwd flops of model = fwd flops per GPU * mp_size"] == number_to_string(4 * FWD).strip()
    assert rows["fwd latency"] == "2 ms" and rows["bwd latency"] == "5 ms" and rows["step latency"] == "1 ms"
    assert rows["iter latency"] == "8 ms"
    bwd_rate, iter_rate = flops_to_string(2.5 * FWD / 5e-3), flops_to_string(3.5 * FWD / 8e-3)
    assert rows["bwd FLOPS per GPU = 2.5 * fwd flops per GPU / bwd latency"] == bwd_rate
    assert rows["FLOPS per GPU = 3.5 * fwd flops per GPU / iter latency"] == iter_rate
    assert rows["samples/second"] == str(round(3 * 8 / 8e-3, 2))  # micro batch x world size / iter
    prof.end_profile()


def summary_rows(text: str) -> dict[str, str]:
    """The summary's rows, label -> value (DeepSpeed's row format: label, ':', padding, value)."""
    summary = text.split("Aggregated Profile")[0]
    rows = [line.split(": ", 1) for line in summary.splitlines() if re.match(r".{70}  ", line)]
    return {label: value.strip() for label, value in rows}


# --- DeepSpeed's lifecycle -------------------------------------------------------------------------


def test_print_before_start_and_after_end_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    model = mlp()
    prof = FlopsProfiler(model)
    assert prof.print_model_profile() is None and not prof.started
    prof.start_profile()
    model(torch.randn(B, IN))
    prof.stop_profile()
    assert prof.started
    assert prof.print_model_profile(output_file=os.devnull) is not None
    prof.end_profile()
    assert prof.print_model_profile() is None and prof.print_model_aggregated_profile() is None
    assert capsys.readouterr().out == ""


def test_get_module_getters_read_the_profile_and_write_nothing_on_modules() -> None:
    model, x = mlp(), torch.randn(B, IN)
    before = [sorted(vars(m)) for m in model.modules()]
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    assert get_module_flops(model[0]) == 2 * B * IN * HID  # during the profile
    prof.stop_profile()
    m = prof.get_profile().modules
    assert [get_module_flops(model[i]) for i in range(3)] == [m[n].fwd_flops for n in ("0", "1", "2")]
    assert get_module_macs(model) == B * IN * HID + B * HID * OUT
    assert get_module_duration(model[2]) == m["2"].fwd_latency > 0
    assert [sorted(vars(m)) for m in model.modules()] == before
    prof.end_profile()
    with pytest.raises(ValueError, match="get_module_flops: module Linear has no profile"):
        get_module_flops(model[0])


def test_a_profile_of_a_submodule_inside_the_models_leaves_the_getters_reading_the_models_after_it() -> None:
    model, x = mlp(), torch.randn(B, IN)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    inner = FlopsProfiler(model[2])
    inner.start_profile()
    assert get_module_flops(model[2]) == 0  # the latest profile of it: nothing ran since it started
    inner.end_profile()
    assert get_module_flops(model[0]) == 2 * B * IN * HID
    assert get_module_flops(model[2]) == 2 * B * HID * OUT  # the model's profile (it raised: no profile)
    get_model_profile(model[2], input_shape=(B, HID), print_profile=False)  # started and ended inside
    # the model's profile again, which counted that profile's two calls of it too (warm-up, counting)
    assert get_module_macs(model[2]) == 3 * B * HID * OUT
    prof.end_profile()
    with pytest.raises(ValueError, match="get_module_flops: module Linear has no profile"):
        get_module_flops(model[2])


def test_a_stop_out_of_the_modes_order_is_refused_with_nothing_changed_and_each_count_stays_whole() -> None:
    """torch takes modes off last in, first out: stopping a profile while a mode entered after it is on
    would take that mode off instead (the later profiler, a FlopCounterMode then counted nothing)."""
    first, second, x = nn.Linear(IN, HID), nn.Linear(IN, OUT), torch.randn(B, IN)
    a, b = FlopsProfiler(first), FlopsProfiler(second)
    a.start_profile()
    b.start_profile()
    with pytest.raises(RuntimeError, match="another profile of flops_callbacks .* still on; torch's modes"):
        a.stop_profile()
    with pytest.raises(RuntimeError, match="still on"):
        a.start_profile()  # a restart stops first
    second(x)
    first(x)
    b.stop_profile()
    a.stop_profile()  # in order now
    assert (a.get_total_flops(), b.get_total_flops()) == (2 * B * IN * HID, 2 * B * IN * OUT)
    b.end_profile()
    a.end_profile()
    model, counter = nn.Linear(IN, HID), FlopCounterMode(display=False)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with counter:
        model(x)
        with pytest.raises(RuntimeError, match="torch.utils.flop_counter._FlopCounterMode was entered"):
            prof.end_profile()
        model(x)
    assert prof.get_total_flops() == counter.get_total_flops() == 2 * 2 * B * IN * HID
    prof.end_profile()
    assert not _get_current_dispatch_mode_stack() and not _get_current_function_mode_stack()


def test_module_list_duration_is_its_childrens_as_deepspeed() -> None:
    model = SimpleModel(4)
    prof = FlopsProfiler(model)
    with prof:
        model(torch.randn(2, 4), torch.tensor([0, 1]))
    assert get_module_duration(model.linears) == get_module_duration(model.linears[0]) > 0
    prof.end_profile()


# --- get_model_profile: eval mode, then the caller's modes back -------------------------------------


class Normalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.drop, self.head = nn.BatchNorm1d(IN), nn.Dropout(0.5), nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.norm(x)))


def test_get_model_profile_runs_in_eval_mode_and_restores_every_submodule_mode() -> None:
    model = Normalized().train()
    model.head.eval()  # a caller's mixed modes come back as they were
    stats = model.norm.running_mean.clone(), model.norm.num_batches_tracked.clone()
    flops, _, _ = get_model_profile(model, input_shape=(B, IN), print_profile=False, as_string=False)
    # eval BatchNorm applies its statistics (2 flops per element with affine); dropout is a no-op
    assert flops == 2 * B * IN + 2 * B * IN * OUT
    assert torch.equal(model.norm.running_mean, stats[0])
    assert torch.equal(model.norm.num_batches_tracked, stats[1])
    assert [m.training for m in (model, model.norm, model.drop, model.head)] == [True, True, True, False]


def test_get_model_profile_restores_modes_when_the_model_raises() -> None:
    class Fails(Normalized):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.training:
                raise RuntimeError("eval forward fails")
            return super().forward(x)

    model = Fails().train()
    with pytest.raises(RuntimeError, match="eval forward fails"):
        get_model_profile(model, input_shape=(B, IN), print_profile=False, warm_up=0)
    assert all(m.training for m in model.modules())
    assert not torch.utils._python_dispatch._get_current_dispatch_mode_stack()


def test_get_model_profile_strings_are_deepspeeds() -> None:
    flops, macs, params = get_model_profile(mlp(), input_shape=(B, IN), print_profile=False)
    assert (flops, macs, params) == (f"{round(FWD / 1e3, 2):g} K", "704 MACs", "195")


# --- the flops_profiler block of a DeepSpeed config --------------------------------------------------


def test_deepspeed_config_block_gives_the_callback_arguments(tmp_path: Path) -> None:
    """DeepSpeed's keys, its whole report (``report="full"``), its ``output_file: ""`` the console; from
    a dict, or the JSON file a config usually is (as the HF Trainer's ``deepspeed=`` takes it)."""
    block = {"enabled": True, "profile_step": 5, "module_depth": 2, "top_modules": 3, "detailed": False}
    expected = {**block, "output_file": None, "report": "full"}
    del expected["enabled"]
    assert deepspeed_callback_kwargs({"train_batch_size": 8, "flops_profiler": block}) == expected
    assert deepspeed_callback_kwargs(block) == expected
    assert deepspeed_callback_kwargs({"enabled": True, "output_file": ""}) == {
        "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True, "output_file": None,
        "report": "full",
    }  # fmt: skip
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_batch_size": 8, "flops_profiler": block}))
    assert deepspeed_callback_kwargs(config) == deepspeed_callback_kwargs(str(config)) == expected
    with pytest.raises(ValueError, match="config: cannot read a DeepSpeed JSON config from '.*missing.json'"):
        deepspeed_callback_kwargs(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="config: '.*list.json' holds no JSON object"):
        deepspeed_callback_kwargs(tmp_path / "list.json")
    assert deepspeed_callback_kwargs({"flops_profiler": {**block, "enabled": False}}) is None
    assert deepspeed_callback_kwargs({"flops_profiler": {"profile_step": 5}}) is None  # off by default
    assert deepspeed_callback_kwargs({"train_batch_size": 8}) is None


def test_deepspeed_config_recompute_factor_and_unknown_keys_are_said_once_and_ignored() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = deepspeed_callback_kwargs({"enabled": True, "recompute_fwd_factor": 1.0})
    assert kwargs is not None and "recompute_fwd_factor" not in kwargs
    (note,) = [str(w.message) for w in caught]
    assert "recompute_fwd_factor is ignored" in note and "\n" not in note
    with pytest.warns(UserWarning, match=r"keys \['step'\] are not DeepSpeed's"):
        assert deepspeed_callback_kwargs({"enabled": True, "step": 1})["profile_step"] == 1  # type: ignore[index]
    with pytest.raises(ValueError, match="flops_profiler.enabled must be True or False"):
        deepspeed_callback_kwargs({"enabled": "yes"})


FIRST_PROFILE = """
import json, sys, torch
from flops_callbacks import FlopsProfiler
from tests.sleepy import Sleepy
model, x = Sleepy(fwd=0.1, bwd=0.0), torch.randn(2, 4)
seconds, imported = [], []
for _ in range(2):
    prof = FlopsProfiler(model)
    prof.start_profile()
    before = set(sys.modules)
    with torch.no_grad():
        model(x)
    imported.append(sorted(set(sys.modules) - before))
    prof.stop_profile()
    seconds.append(prof.get_total_duration())
    prof.end_profile()
print(json.dumps([seconds, imported]))
"""


def test_the_first_profile_of_a_fresh_process_times_no_lazy_import() -> None:
    """A forward of 0.1 s of sleep: torch imports ``torch._dynamo`` (about a second) on a mode's first
    call, which must not land in the first profile's timed forward."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", FIRST_PROFILE], capture_output=True, text=True, cwd=root, timeout=300,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (first, second), imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == [[], []]  # nothing imported inside a timed forward
    assert first - second < 0.05, (first, second)  # a lazy import reads a second, a late wake-up far less


# --- get_model_profile does no harm ------------------------------------------------------------------


def test_get_model_profile_with_backward_leaves_every_grad_bitwise_and_says_its_mode() -> None:
    """Between a user's backward and optimizer.step(): the gradients the step will apply are the
    user's, bitwise (the very tensors), and a parameter without one still has none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4), nn.Linear(4, 4))
    model.train()
    x = torch.randn(5, 8)
    model[0](x).sum().backward()  # only the first layer has gradients
    grads = {name: p.grad for name, p in model.named_parameters()}
    copies = {name: None if g is None else g.clone() for name, g in grads.items()}
    result = get_model_profile(model, args=[x], backward=True, print_profile=False, as_string=False)
    for name, p in model.named_parameters():
        assert p.grad is grads[name], name
        if copies[name] is None:
            assert p.grad is None, name
        else:
            assert torch.equal(p.grad, copies[name]) and p.grad.view(torch.int32).equal(
                copies[name].view(torch.int32)
            ), name
    assert model.training and all(m.training for m in model.modules())
    flops, macs, params = result
    assert result.mode == "eval" and params == sum(p.numel() for p in model.parameters())


def test_get_model_profile_report_says_the_mode_and_the_counting_pass_points_to_step_profiler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = nn.Linear(4, 4)
    get_model_profile(model, args=[torch.randn(2, 4)], print_profile=True)
    assert "eval (model.eval(), as DeepSpeed's get_model_profile" in capsys.readouterr().out
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 4))
    prof.stop_profile()
    text = prof.print_model_profile(output_file=None) or ""
    prof.end_profile()
    assert "the counting pass" in text and "StepProfiler" in text
    assert "StepProfiler" in (FlopsProfiler.get_total_duration.__doc__ or "")


def test_get_model_profile_calls_the_model_in_the_callers_grad_mode_and_once_when_not_printing() -> None:
    """A force field's forward takes the energy's gradient itself: under the ``no_grad`` the call ran in,
    it raised where DeepSpeed's returns; without a report to print, the two timing passes ran anyway."""

    class Force(nn.Module):
        calls = 0

        def __init__(self) -> None:
            super().__init__()
            self.energy = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            Force.calls += 1
            x = x.requires_grad_(True)
            return -torch.autograd.grad(self.energy(x).sum(), x)[0]

    flops, macs, params = get_model_profile(
        Force(), args=[torch.randn(5, 3)], print_profile=False, warm_up=1, as_string=False
    )
    assert (macs, params) == (5 * 3 * 16 + 5 * 16 * 1, 3 * 16 + 16 + 16 + 1)  # the two Linears' forward
    assert Force.calls == 2  # the warm-up and the counted call
