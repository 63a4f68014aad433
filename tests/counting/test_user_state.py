"""What a fake count's replay could change is put back: attributes, the contents of the containers in
them (through the base types' methods, whatever a subclass's own do), the global random state; a large
container's items are not looked into, and what cannot be put back is said."""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from typing import Any

import numpy
import torch

from flops_callbacks.counting.user_state import BUDGET, LOOK_INSIDE, Kept


class Frozen(dict):
    """A dict subclass that refuses updates once made (as transformers' ``ModelOutput`` does)."""

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("frozen")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise RuntimeError("frozen")


class Holder:
    pass


def test_attributes_containers_and_the_random_state_are_put_back() -> None:
    holder = Holder()
    inner = [1]
    holder.losses, holder.nested, holder.frozen = [inner], ({"k": inner},), Frozen(a=1)
    holder.seen, holder.count = {1}, 0
    random.seed(3)
    numpy.random.seed(3)
    state = random.getstate(), numpy.random.get_state()[1].copy()
    saved = Kept([holder])
    holder.losses.append(2)
    inner.append(3)  # a list inside a tuple inside an attribute
    dict.__setitem__(holder.frozen, "b", 2)
    holder.seen.add(2)
    holder.count, holder.extra = 5, "new"
    random.random(), numpy.random.rand()
    saved.restore()
    assert saved.unrestored == []
    assert (holder.losses, inner, dict(holder.frozen)) == ([[1]], [1], {"a": 1})
    assert (holder.seen, holder.count) == ({1}, 0)
    assert not hasattr(holder, "extra")
    assert random.getstate() == state[0] and (numpy.random.get_state()[1] == state[1]).all()


def test_a_deques_window_and_a_dicts_order_are_put_back() -> None:
    holder = Holder()
    first, second = object(), object()
    holder.recent = deque([first, second], maxlen=2)  # a running window of the last losses
    holder.by_name = {"a": 1, "b": 2}
    saved = Kept([holder])
    holder.recent.append(object())  # drops `first`
    holder.by_name["a"] = holder.by_name.pop("a")  # the same items, "a" now last
    saved.restore()
    assert saved.unrestored == []
    assert list(holder.recent) == [first, second] and holder.recent.maxlen == 2
    assert list(holder.by_name) == ["a", "b"]


def test_an_ordered_dicts_own_order_is_kept_and_put_back_through_its_own_methods() -> None:
    # a module's hooks live in OrderedDicts; one registered with prepend=True sits first in the
    # OrderedDict's order, not the dict's: nothing changed must read as nothing changed
    linear = torch.nn.Linear(2, 2)
    calls: list[str] = []
    linear.register_forward_pre_hook(lambda *_: calls.append("first"))
    linear.register_forward_pre_hook(lambda *_: calls.append("prepended"), prepend=True)
    holder = Holder()
    holder.cache = OrderedDict(a=1, b=2, c=3)
    holder.cache.move_to_end("a")  # an LRU cache's order: b, c, a
    saved = Kept([linear, holder])
    Kept([linear]).restore()  # nothing changed in between: the hooks stay as they are
    linear(torch.zeros(2))
    assert calls == ["prepended", "first"]
    holder.cache.move_to_end("b")  # c, a, b
    holder.cache["d"] = 4
    saved.restore()
    assert saved.unrestored == []
    assert list(holder.cache.items()) == [("b", 2), ("c", 3), ("a", 1)]
    holder.cache.move_to_end("b")  # its links still whole: it moves, iterates and pops as an OrderedDict
    assert list(holder.cache) == ["c", "a", "b"] and holder.cache.popitem(last=False) == ("c", 3)


def test_a_large_containers_items_are_not_looked_into_but_the_container_is_kept() -> None:
    holder = Holder()
    rows = [{"input_ids": [1, 2, 3]} for _ in range(LOOK_INSIDE + 1)]  # a dataset of plain lists
    holder.train_dataset = rows
    saved = Kept([holder])
    rows.append({"input_ids": [4]})
    rows[0]["input_ids"].append(9)  # inside a row: not looked into (nor copied, at each fake count)
    saved.restore()
    assert len(holder.train_dataset) == LOOK_INSIDE + 1 and holder.train_dataset is rows
    assert rows[0]["input_ids"] == [1, 2, 3, 9]


def test_past_the_budget_the_attributes_own_containers_are_still_kept_and_incomplete_says_why() -> None:
    # a corpus of 1000 documents of 1001 tokens held before the outputs list: 1,001,000 items to copy, over
    # the budget: the walk goes level by level, so the outputs (an attribute's own list) are kept
    holder = Holder()
    holder.corpus = [[0] * 1001 for _ in range(1000)]
    holder.outputs = []
    saved = Kept([holder])
    assert BUDGET < 1000 * 1001
    assert saved.incomplete == "the model and trainer hold over 1,000,000 items in containers"
    holder.outputs.append(torch.ones(()))
    saved.restore()
    assert holder.outputs == [] and Kept([Holder()]).incomplete == ""


def test_the_users_own_random_generators_are_put_back_where_the_model_or_trainer_holds_them() -> None:
    holder = Holder()
    holder.rng, holder.numpy_rng = random.Random(3), numpy.random.default_rng(3)
    holder.torch_rng = torch.Generator().manual_seed(3)
    holder.augment = {"legacy": numpy.random.RandomState(3)}  # inside a container too
    first = (holder.rng.random(), holder.numpy_rng.random(), torch.rand(1, generator=holder.torch_rng).item())
    legacy = holder.augment["legacy"].rand()
    holder.rng.seed(3)
    holder.numpy_rng, holder.torch_rng = numpy.random.default_rng(3), torch.Generator().manual_seed(3)
    holder.augment["legacy"].seed(3)
    saved = Kept([holder])
    holder.rng.random(), holder.numpy_rng.random(), torch.rand(1, generator=holder.torch_rng)
    holder.augment["legacy"].rand()  # a replay's draws
    saved.restore()
    again = (holder.rng.random(), holder.numpy_rng.random(), torch.rand(1, generator=holder.torch_rng).item())
    assert again == first and holder.augment["legacy"].rand() == legacy


class Locking(list):
    """A list that refuses its length once locked."""

    locked = False

    def __len__(self) -> int:
        if self.locked:
            raise RuntimeError("locked")
        return super().__len__()


def test_a_class_is_passed_over_and_what_cannot_be_put_back_is_said() -> None:
    class Kind:
        value = 1

    holder = Holder()
    holder.items = Locking([0])
    saved = Kept([Kind, holder])  # a class's namespace is a read-only mappingproxy: not kept
    Kind.value = 2
    holder.items.append(1)
    holder.items.locked = True
    holder.count = 1
    saved.restore()
    assert Kind.value == 2 and not hasattr(holder, "count")  # the rest is put back all the same
    assert saved.unrestored == ["a Locking (RuntimeError: locked)"]


class Counted(torch.nn.Module):
    """A model that counts its calls and keeps its losses on its class, as a step schedule may."""

    calls = 0
    history: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        Counted.history.append(x)
        return x


def test_the_classes_attributes_are_put_back_but_torchs_own_classes_are_not_looked_at() -> None:
    model = torch.nn.Sequential(Counted(), torch.nn.Linear(2, 2))
    Counted.calls, Counted.history = 3, [1]
    history = Counted.history
    saved = Kept([*model.modules()])
    model(torch.ones(2))
    Counted.added = "new"  # type: ignore[attr-defined]
    saved.restore()
    assert saved.unrestored == []
    assert Counted.calls == 3 and Counted.history is history and history == [1]
    assert not hasattr(Counted, "added")
    assert torch.nn.Linear not in [cls for cls, _ in saved._classes]
    assert Counted in [cls for cls, _ in saved._classes]


class Refusing(type):
    """A metaclass that refuses to delete one attribute of its classes."""

    def __delattr__(cls, name: str) -> None:
        if name == "kept":
            raise AttributeError("cannot delete kept")
        super().__delattr__(name)


class Guarded(torch.nn.Module, metaclass=type("RefusingModule", (Refusing, type(torch.nn.Module)), {})):
    steps = 0


def test_a_class_that_refuses_one_write_still_has_its_other_attributes_put_back() -> None:
    saved = Kept([Guarded()])
    Guarded.steps, Guarded.kept, Guarded.added = 5, 1, 2  # type: ignore[attr-defined]
    saved.restore()
    assert saved.unrestored == ["Guarded.kept (AttributeError: cannot delete kept)"]
    assert Guarded.steps == 0 and not hasattr(Guarded, "added") and Guarded.kept == 1
