"""Batches as users feed them, on a real ``transformers.Trainer``: dynamic padding (transformers'
``DataCollatorForLanguageModeling``, each batch padded to its longest sequence) and padding-free packing
(``DataCollatorWithFlattening``: several sequences in one row, ``position_ids`` restarting at each).

The references are independent: torch's ``FlopCounterMode`` (SDPA's math backend: attention as matmuls)
on the batch a step ran, for the work as run, and on each of its sequences alone, for the model's work.
Models and the tokenizer are built in memory; nothing is downloaded.
"""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)

from flops_callbacks import metrics as names
from flops_callbacks.integrations.hf import HFFlopsCallback
from flops_callbacks.reporting.publish import picture
from flops_callbacks.reporting.window_rows import layout_lines, module_source
from flops_callbacks.session.shape_flops import BatchCounts
from tests.support import check_step, loss_counts

VOCAB, PEAK = 512, 1e12


class Recorded:
    """A collator that keeps every batch it made, in order (batch ``i`` is global step ``i``'s)."""

    def __init__(self, collate: Any) -> None:
        self.collate, self.batches = collate, []

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collate(samples)
        self.batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return batch


class Lengths(torch.utils.data.Dataset):
    """Token sequences of random lengths ``low`` .. ``high`` (with labels: a causal LM's)."""

    def __init__(self, size: int, low: int, high: int, labels: bool = False) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(low, high + 1, (size,), generator=generator).tolist()
        self.items = [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]
        self.labels = labels

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        ids = self.items[i]
        return {"input_ids": ids, "labels": ids} if self.labels else {"input_ids": ids}


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``VOCAB`` tokens, built in memory (pad: token 0)."""
    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1")), pad_token="[PAD]"
    )


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=256, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def train(
    tmp_path: Path, model: torch.nn.Module, data: torch.utils.data.Dataset, collator: Recorded, batch: int,
    steps: int, **options: Any,
) -> HFFlopsCallback:  # fmt: skip
    settings = {"profile_step": 5, "clean_steps": 5, "peak_flops": PEAK}  # five: the median is one step
    callback = HFFlopsCallback(**{**settings, **options})
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps, per_device_train_batch_size=batch,
        logging_steps=5, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        remove_unused_columns=False, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=data, data_collator=collator, callbacks=[callback]
    )
    trainer.train()
    return callback


def dense_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """torch's count of one training micro-batch's forward and backward (matmuls and attention)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def saved(tmp_path: Path, step: int) -> dict[str, Any]:
    found = list(tmp_path.rglob(f"flops_profile_step{step}.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def test_dynamic_padding_keeps_the_module_view_and_counts_the_model_flops_on_real_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    collator = Recorded(DataCollatorForLanguageModeling(tokenizer(), mlm=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback = train(tmp_path, gpt2(), Lengths(8 * 24, 16, 128), collator, batch=8, steps=20)
    result = callback.result
    assert result is not None
    assert not [w for w in caught if "flops_callbacks" in str(w.message)], [str(w.message) for w in caught]
    steps, summary = result.steps, capsys.readouterr().out
    # the module view is there: the tree of a module-timing step, its latencies, in every rendering
    assert steps.module_shapes_match and steps.profile_step in steps.module_timing
    assert "no module timing" not in summary and "no module latencies" not in summary
    modules = {n: m for n, m in result.profile.modules.items() if n}
    assert all(m.fwd_latency > 0 and m.bwd_latency > 0 for m in modules.values() if m.fwd_flops)
    data = saved(tmp_path, result.step)
    assert data["steps"]["profile_step"] == steps.profile_step
    assert all(m["fwd_latency"] > 0 for n, m in data["profile"]["modules"].items() if n and m["fwd_flops"])
    source = module_source(result)  # the picture's "module latencies" row, and its tree's widths
    assert source.startswith("step") and html.escape(source) in picture(result)
    # its flops are that step's batch's: torch's dense count within 0.5% of the tree's 2 x MACs
    root = result.profile.model
    batch = collator.batches[steps.profile_step]
    reference = dense_flops(gpt2(), batch)
    assert 2 * (root.fwd_macs + root.bwd_macs) == pytest.approx(reference, rel=0.005)
    # FLOPS leave the padding out: the median clean step's model flops are its rows' work alone
    median = result.figures().median_step()
    ran = collator.batches[steps_of(result, median)]
    lengths = ran["attention_mask"].sum(dim=1).tolist()
    alone = sum(
        dense_flops(gpt2(), {k: v[r : r + 1, :n] for k, v in ran.items()}) for r, n in enumerate(lengths)
    )
    counts = median.work.counts
    assert 0.995 <= counts.model_flops / alone <= 1.025, counts.model_flops / alone
    assert 2 * (counts.fwd_macs + counts.bwd_macs) == dense_flops(gpt2(), ran)  # as run: the padded batch
    metrics = result.metrics()
    assert metrics[names.MFU] == pytest.approx(counts.model_flops / result.iter_latency / PEAK, rel=1e-9)
    assert metrics[names.HFU] == pytest.approx(counts.hardware_flops / result.iter_latency / PEAK, rel=1e-9)


def test_packed_rows_count_each_sequence_as_a_sample_and_its_work_alone(tmp_path: Path) -> None:
    collator = Recorded(DataCollatorWithFlattening())
    data = Lengths(4 * 24, 165, 204, labels=True)
    callback = train(tmp_path, llama(), data, collator, batch=4, steps=16)
    result = callback.result
    assert result is not None
    figures = result.figures()
    # samples are sequences: four a row, in every clean step, in samples/s and in the profile's step
    assert [s.work.samples for s in figures.steps] == [4] * len(figures.steps)
    assert result.samples == 4
    median = figures.median_step()
    assert result.metrics()[names.SAMPLES_PER_SEC] == pytest.approx(4 / result.iter_latency, rel=1e-9)
    # the model's work: each sequence alone; the hardware's: the packed row as the kernels ran it
    at = steps_of(result, median)
    ran = collator.batches[at]
    starts = (ran["position_ids"][0] == 0).nonzero().view(-1).tolist() + [ran["input_ids"].shape[1]]
    alone = sum(
        dense_flops(llama(), {k: v[:, a:b] for k, v in ran.items() if k != "position_ids"})
        for a, b in zip(starts, starts[1:], strict=False)
    )
    packed = dense_flops(llama(), ran)
    counts = median.work.counts
    assert packed > 1.1 * alone  # the masked-out pairs of the row: work the kernels ran, not the model's
    assert 0.995 <= counts.model_flops / alone <= 1.025, counts.model_flops / alone
    assert 2 * (counts.fwd_macs + counts.bwd_macs) == packed
    assert result.metrics()[names.MFU] == pytest.approx(
        counts.model_flops / result.iter_latency / PEAK, rel=1e-9
    )


def steps_of(result: Any, clean: Any) -> int:
    """The global step of the clean step ``clean`` (one of the result's figures)."""
    steps = result.figures().steps
    return result.steps.clean[[i for i, s in enumerate(steps) if s == clean][0]]


class Translations(torch.utils.data.Dataset):
    """Pairs of an input of 20 .. 40 tokens and labels of 4 .. 12: the decoder's rows always shorter."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        inputs = torch.randint(20, 41, (size,), generator=generator).tolist()
        labels = torch.randint(4, 13, (size,), generator=generator).tolist()
        self.items = [
            {"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist(),
             "labels": torch.randint(1, VOCAB, (k,), generator=generator).tolist()}
            for n, k in zip(inputs, labels, strict=True)
        ]  # fmt: skip

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]


def t5() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


def test_an_encoder_decoder_counts_each_row_with_its_encoders_and_its_decoders_own_tokens(
    tmp_path: Path,
) -> None:
    """``DataCollatorForSeq2Seq``: each row is a pair, its encoder cut by its mask and its decoder by its
    labels (-100 where padding): the model flops are each example's counted alone."""
    collator = Recorded(DataCollatorForSeq2Seq(tokenizer(), model=t5(), label_pad_token_id=-100))
    callback = train(tmp_path, t5(), Translations(8 * 20), collator, batch=8, steps=15)
    result = callback.result
    assert result is not None and result.layout is not None and not result.layout.decoder_padding
    assert saved(tmp_path, result.step)["batch_layout"]["decoder_padding"] is False
    assert "model flops of an encoder-decoder" not in dict(layout_lines(result))
    reference = t5()  # counted on each example alone, its gradients dropped after each

    def alone(row: dict[str, torch.Tensor], num_items_in_batch: torch.Tensor) -> BatchCounts:
        counts = loss_counts(reference, row, num_items_in_batch=num_items_in_batch)
        reference.zero_grad(set_to_none=True)
        return counts

    for clean in result.figures().steps:
        ran = collator.batches[steps_of(result, clean)]
        encoder, decoder = (
            ran["attention_mask"].sum(dim=1).tolist(),
            (ran["labels"] != -100).sum(dim=1).tolist(),
        )
        pairs = list(zip(encoder, decoder, strict=True))
        rows = [
            {k: v[r : r + 1, : (d if k in ("labels", "decoder_input_ids") else n)] for k, v in ran.items()}
            for r, (n, d) in enumerate(pairs)
        ]
        engine = [alone(row, (ran["labels"] != -100).sum()) for row in rows]
        model = clean.work.counts
        assert model.model_fwd_flops == sum(c.fwd_flops for c in engine)
        assert model.model_bwd_flops == sum(c.bwd_flops for c in engine)
        # torch's count of the same examples alone: its matmuls and attention (ours adds the elementwise)
        assert 1.0 <= model.model_flops / sum(dense_flops(reference, row) for row in rows) <= 1.03
        assert model.hardware_flops > 1.2 * model.model_flops  # both stacks' padding is worth leaving out


def test_gpt2_fed_input_ids_and_labels_counts_new_shapes_off_the_clock(tmp_path: Path) -> None:
    """transformers 5 builds GPT-2's mask with integer ops under fake tensors (it reads its position ids
    on a real step): they do no floating-point work, so the fake count is the real one."""

    def padded(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.tensor([s["input_ids"] + [1] * (longest - len(s["input_ids"])) for s in samples])
        return {"input_ids": ids, "labels": ids}

    collator = Recorded(padded)
    callback = train(tmp_path, gpt2(), Lengths(8 * 24, 16, 128), collator, batch=8, steps=20)
    result = callback.result
    assert result is not None and result.flops_sources is not None
    assert result.steps.shape_counting == (check_step(5),)  # the check's count only: no other step counted
    assert result.flops_sources.on_steps == ""
    assert result.steps.shapes > 3 and not result.steps.skipped


def test_a_counts_file_without_model_slots_reads_as_run() -> None:
    """A profile file written before model flops were apart reads its counts as the batch's own work."""
    counts = {"fwd_flops": 3, "bwd_flops": 5, "recompute_flops": 1, "fwd_macs": 1, "bwd_macs": 2}
    read = BatchCounts.from_dict({**counts, "recompute_macs": 0})
    assert (read.model_flops, read.hardware_flops) == (8, 9)
