"""A fake count: the engine's counts of one micro-batch run under fake tensors equal a real step's, pass
by pass, bytes moved included; nothing of the model, its gradients or the random state changes; and what
fake tensors cannot stand for is said, not counted."""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from collections.abc import Iterator, MutableMapping
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GPT2Config, GPT2LMHeadModel

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.counting.fake_count import FakeCountUnavailable, fake_count
from flops_callbacks.profile import Counts


def _lm_step(model: nn.Module, batch: Any) -> None:
    model(**batch).loss.backward()


def _real(model: nn.Module, batch: Any, later: bool) -> Counts:
    if later:
        _lm_step(model, batch)  # the micro-batch before: the gradients this one adds to
    tracer = CountingEngine(model)
    tracer.start()
    try:
        _lm_step(model, batch)
    finally:
        tracer.stop()
    model.zero_grad(set_to_none=True)
    return tracer.totals()[0]


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).train()


@pytest.mark.parametrize("later", [False, True])
@pytest.mark.parametrize("mask", ["none", "padded", "all ones"])
def test_a_fake_count_equals_the_real_count_of_the_same_batch(
    gpt2: nn.Module, mask: str, later: bool
) -> None:
    ids = torch.randint(0, 500, (3, 40))
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "labels": ids}
    if mask != "none":
        batch["attention_mask"] = torch.ones_like(ids)
        if mask == "padded":
            batch["attention_mask"][0, 30:] = 0  # the model checks its mask's content: the same branch
    params = {name: (p, p.detach().clone()) for name, p in gpt2.named_parameters()}
    rng = torch.get_rng_state()
    counted = fake_count(gpt2, _lm_step, batch, later=later)
    assert torch.equal(rng, torch.get_rng_state())
    now = dict(gpt2.named_parameters())
    for name, (param, value) in params.items():
        assert now[name] is param and torch.equal(param, value) and param.grad is None
    assert counted.fwd_flops > 0
    real = _real(gpt2, batch, later)
    assert counted.saved_bytes > 0  # a fake storage stands for its memory: each is counted once
    assert counted == real


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)


def test_a_fake_count_of_a_linear_layer_is_its_matmuls_by_hand() -> None:
    model = _Mlp().eval()
    counted = fake_count(model, lambda m, x: m(x).sum().backward(), torch.randn(4, 8))
    assert (counted.fwd_flops, counted.fwd_macs) == (2 * 4 * 8 * 16, 4 * 8 * 16)  # the sum is not the model's
    assert counted.bwd_flops == 2 * 4 * 8 * 16  # the weight's gradient (the input needs none)
    assert not model.training and model.up.weight.grad is None


class _Gather(nn.Module):
    """Work on the rows its mask keeps: a shape that depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x)[x[:, 0] > 0]


def test_a_shape_that_depends_on_the_data_is_said_not_counted() -> None:
    model = _Gather()
    with pytest.raises(FakeCountUnavailable, match="Dynamic|data"):
        fake_count(model, lambda m, x: m(x).sum().backward(), torch.randn(4, 8))
    assert model.up.weight.grad is None and model.training


def test_an_op_whose_meta_kernel_fails_is_said_once_and_torch_logs_no_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fake tensors log a failing meta kernel's traceback at ERROR before they raise (22 lines on the
    console for an MoE's ``aten._grouped_mm`` in fp32 on a CPU); the fake count says why it cannot run."""
    library = torch.library.Library("fc_fake_count_test", "DEF")
    library.define("no_meta(Tensor x) -> Tensor")
    library.impl("no_meta", lambda x: x.clone(), "CPU")

    def meta(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this meta kernel wants bf16")

    library.impl("no_meta", meta, "Meta")
    model = _Mlp()
    step = lambda m, x: torch.ops.fc_fake_count_test.no_meta(m(x)).sum().backward()  # noqa: E731
    step(model, torch.randn(4, 8))  # the real kernel runs
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.DEBUG), pytest.raises(FakeCountUnavailable, match="wants bf16"):
        fake_count(model, step, torch.randn(4, 8))
    assert [r for r in caplog.records if r.name.startswith("torch")] == []
    assert not logging.getLogger("torch._subclasses.fake_tensor").disabled


def test_a_failure_in_the_step_function_is_said_and_the_model_left_as_it_was() -> None:
    model = _Mlp()

    def step(m: nn.Module, x: torch.Tensor) -> None:
        m.eval()
        raise ValueError("the user's step")

    with pytest.raises(FakeCountUnavailable, match="ValueError: the user's step"):
        fake_count(model, step, torch.randn(4, 8))
    assert model.training and isinstance(model.up.weight, nn.Parameter)


class _Owner:
    """A trainer as the step function's owner: attributes its step may change."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.calls = 0


class _UserStep:
    """A user's step with effects beyond the tensors: Python's and NumPy's random numbers drawn, a loss
    kept on the model and on the owner (appended, assigned, in a dict of lists), a call counted."""

    def __init__(self, owner: _Owner, fail: bool = False) -> None:
        self.owner, self.fail = owner, fail

    def __call__(self, m: nn.Module, x: torch.Tensor) -> None:
        loss = m(x).sum() * (1 + random.random() + float(numpy.random.rand()))
        m.outputs.append(loss)
        m.history["train"].append(loss)
        m.last, m.new_attribute = loss, loss
        self.owner.losses.append(loss)
        self.owner.calls += 1
        if self.fail:
            raise ValueError("the user's step")
        loss.backward()


@pytest.mark.parametrize("fail", [False, True])
def test_what_the_users_step_changes_beside_the_tensors_is_put_back(fail: bool) -> None:
    model, owner = _Mlp(), _Owner()
    real = torch.ones(())
    model.outputs, model.history, model.last = [real], {"train": [real]}, real
    random.seed(1)
    numpy.random.seed(1)
    before = (random.getstate(), numpy.random.get_state()[1].copy(), dict(model.__dict__))
    if fail:
        with pytest.raises(FakeCountUnavailable, match="ValueError: the user's step"):
            fake_count(model, _UserStep(owner, fail), torch.randn(4, 8))
    else:
        assert fake_count(model, _UserStep(owner), torch.randn(4, 8)).fwd_flops > 0
    assert random.getstate() == before[0] and (numpy.random.get_state()[1] == before[1]).all()
    assert model.__dict__ == before[2] and not hasattr(model, "new_attribute")
    assert model.outputs == [real] and model.history == {"train": [real]} and model.last is real
    assert (owner.losses, owner.calls) == ([], 0)


class _Scheduled(_Mlp):
    """A model whose class counts its steps and keeps their losses (a schedule read by the next step)."""

    steps = 0
    losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Scheduled.steps += 1
        out = super().forward(x) * (1 + _Scheduled.steps)
        _Scheduled.losses.append(out.sum())
        return out


def test_what_the_users_step_writes_on_the_models_class_is_put_back() -> None:
    model, x = _Scheduled(), torch.randn(4, 8)
    _Scheduled.steps, _Scheduled.losses = 0, []
    model(x).sum().backward()  # a real step: the schedule advances
    counted = fake_count(model, lambda m, x: m(x).sum().backward(), x)
    assert counted.fwd_macs == 4 * 8 * 16
    assert _Scheduled.steps == 1 and len(_Scheduled.losses) == 1  # the fake count left no step behind
    assert type(_Scheduled.losses[0]) is torch.Tensor  # and no fake tensor in the class's list


@functools.cache
def _causal_mask(length: int) -> torch.Tensor:
    """A mask cached per length for the whole process, as models do: made by the first step of a length."""
    return torch.ones(length, length).triu(1).bool()


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2)
        return scores.masked_fill(_causal_mask(x.shape[1]), 0.0)


def test_a_mask_a_fake_count_makes_and_the_user_caches_is_real_and_right_for_the_real_steps() -> None:
    # a fake count of a length no real step ran yet: the mask it makes stays in the user's cache (a fake
    # one made the next real step of that length compute a fake loss, and train on nothing)
    _causal_mask.cache_clear()
    model = _Masked()
    counted = fake_count(model, lambda m, x: m(x).sum().backward(), torch.randn(2, 5, 8))
    cached = _causal_mask(5)
    assert type(cached) is torch.Tensor and torch.equal(cached, torch.ones(5, 5).triu(1).bool())
    assert type(model(torch.randn(2, 5, 8)).sum()) is torch.Tensor
    # the matmuls by hand: q 2 x 5 x 8 x 8, scores 2 x 5 x 8 x 5 (MACs), the mask no flops
    assert counted.fwd_macs == 2 * 5 * 8 * 8 + 2 * 5 * 8 * 5


class _Tallied(nn.Module):
    """A model that tallies its labels in a plain tensor (no buffer) and holds a teacher in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.label_counts = torch.zeros(4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, teacher: nn.Module) -> torch.Tensor:
        self.label_counts += torch.bincount(y, minlength=4)  # of the batch alone: a real op before
        return self.lin(x).sum() + teacher(x).sum()


def test_the_users_real_tensors_written_in_place_by_a_replay_are_left_as_they_were() -> None:
    model = _Tallied()
    teacher = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)).train()  # its running statistics move
    counts, stats = model.label_counts, [t.clone() for t in teacher[1].buffers()]
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 1, 3, 3, 3])
    fake_count(model, lambda m, batch: m(*batch, teacher).backward(), (x, y))
    assert model.label_counts is counts and torch.equal(counts, torch.zeros(4))
    assert all(torch.equal(a, b) for a, b in zip(teacher[1].buffers(), stats, strict=True))
    model(x, y, teacher)  # the real step: its own tally, once
    assert model.label_counts.tolist() == [1.0, 2.0, 0.0, 3.0] and teacher[1].num_batches_tracked == 1


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    extra: dict[str, torch.Tensor]


def _doubling_step(model: nn.Module, batch: Any) -> None:
    """A step that keeps its augmented input on its batch, whatever the batch's container."""
    if isinstance(batch, _Batch):
        batch.x = batch.x * 2
        batch.extra["scale"] = batch.extra["scale"] + 1
        x = batch.x
    else:
        batch["x"] = batch["x"] * 2
        x = batch["x"]
    model(x).sum().backward()


@pytest.mark.parametrize("container", ["dataclass", "BatchEncoding", "UserDict", "dict subclass"])
def test_a_replays_writes_to_its_batch_do_not_reach_the_real_steps_batch(container: str) -> None:
    """pytree copies no dataclass, ``UserDict`` (``BatchEncoding``) nor dict's subclass: the replay gets a
    copy of each all the same."""
    from collections import UserDict

    from transformers import BatchEncoding

    class Inputs(dict):
        """A dict's subclass: a leaf to pytree."""

    x, scale = torch.randn(4, 8), torch.ones(1)
    values = x.clone()
    batch: Any = {
        "dataclass": lambda: _Batch(x, {"scale": scale}),
        "BatchEncoding": lambda: BatchEncoding({"x": x}),
        "UserDict": lambda: UserDict({"x": x}),
        "dict subclass": lambda: Inputs(x=x),
    }[container]()
    model = _Mlp()
    counted = fake_count(model, _doubling_step, batch)
    assert counted.fwd_flops == 2 * 4 * 8 * 16
    if container == "dataclass":
        assert batch.x is x and batch.extra == {"scale": scale} and batch.extra["scale"] is scale
    else:
        assert list(batch.keys()) == ["x"] and batch["x"] is x
    assert torch.equal(x, values) and scale.item() == 1.0 and model.up.weight.grad is None


class _Shelf(MutableMapping):
    """A mapping over storage of its own (a shelf, a view): a copy would share it."""

    def __init__(self, store: dict[str, Any]) -> None:
        self.store = store

    def __getitem__(self, key: str) -> Any:
        return self.store[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.store[key] = value

    def __delitem__(self, key: str) -> None:
        del self.store[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)


def test_a_batch_of_a_mapping_the_replay_cannot_copy_has_no_fake_count_and_stays_as_it_was() -> None:
    x = torch.randn(4, 8)
    batch = _Shelf({"x": x})
    with pytest.raises(FakeCountUnavailable, match="a batch's _Shelf cannot be copied for a replay"):
        fake_count(_Mlp(), _doubling_step, batch)
    assert batch.store == {"x": x} and batch["x"] is x


def test_a_model_holding_more_than_the_budget_in_containers_has_no_fake_count() -> None:
    model = _Mlp()
    model.corpus = [[0] * 1001 for _ in range(1000)]  # a corpus of token lists: 1,001,000 items
    model.outputs = []

    def step(m: nn.Module, x: torch.Tensor) -> None:
        m.outputs.append(m(x).sum())

    with pytest.raises(FakeCountUnavailable, match="over 1,000,000 items in containers: too many to put"):
        fake_count(model, step, torch.randn(4, 8))
    assert model.outputs == []


def test_the_users_own_hooks_do_not_run_in_a_fake_count_and_are_there_after_it() -> None:
    # the forum's pattern: a forward hook keeps a module's output for code that reads it after the step
    # (.item() on a fake tensor ends the run); the count is the real step's without the hook's work
    model, kept = _Mlp(), {}
    hooks = model.up._forward_hooks
    model.up.register_forward_hook(lambda module, args, output: kept.update(up=output.detach()))
    counted = fake_count(model, lambda m, x: m(x).sum().backward(), torch.randn(4, 8))
    assert kept == {} and model.up._forward_hooks is hooks and len(hooks) == 1
    assert (counted.fwd_macs, counted.bwd_macs) == (4 * 8 * 16, 4 * 8 * 16)  # the weight's gradient
    model(torch.randn(4, 8))
    assert type(kept["up"]) is torch.Tensor  # the hook runs on the real steps as before


class _IntegerCalls(TorchDispatchMode):
    """The ops called on integer and bool tensors only, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if tensors and not any(t.is_floating_point() for t in tensors):
            self.names.add(str(func))
        return out


@pytest.mark.parametrize("causal", ["full", "half"])
def test_a_gpt2_batch_of_input_ids_and_labels_counts_the_same_faked_and_real(causal: str) -> None:
    # With no attention mask and no cache (HF Trainer's use_cache=False), transformers 5 looks for packed
    # sequences in the position ids it makes with a range: a fake count makes that range for real, so it
    # reads them as the real step does and takes the same branch (no mask: SDPA's is_causal, halved
    # under "half"), op for op; bytes alike.
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False, attn_pdrop=0.0
    )
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    seen = {"fake": _IntegerCalls(), "real": _IntegerCalls()}

    def step(which: str) -> Any:
        def run(m: nn.Module, b: Any) -> None:
            with seen[which]:
                _lm_step(m, b)

        return run

    counted = fake_count(model, step("fake"), batch, causal_attention=causal)  # type: ignore[arg-type]
    engine = CountingEngine(model, causal_attention=causal)  # type: ignore[arg-type]
    engine.start()
    try:
        step("real")(model, batch)
    finally:
        engine.stop()
    real = engine.totals()[0]
    assert seen["fake"].names == seen["real"].names  # the same integer ops: the same branch
    assert counted == real and counted.fwd_macs > 0
