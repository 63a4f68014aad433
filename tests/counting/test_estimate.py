"""The "6 x params x tokens" rows: N is the non-embedding parameters (worked out by hand from each
config), PaLM's attention term is 12 x L x H x Q x T per token, and a causal LM's measured fwd+bwd
flops read 1.00x PaLM's model flops."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import transformers

from flops_callbacks.counting.engine import CountingEngine
from flops_callbacks.counting.estimate import Attention, attention_of, embedding_params, estimate_rows
from flops_callbacks.profile import Profile
from flops_callbacks.units import number_to_string, params_to_string

VOCAB, D, LAYERS, HEADS, POSITIONS = 2000, 256, 4, 4, 512
BATCH, SEQ = 2, 256
TOKENS = BATCH * SEQ


def gpt2() -> tuple[Any, int, int]:
    """GPT-2 (the LM head tied to the token table): config, non-embedding params, table params."""
    config = transformers.GPT2Config(
        n_layer=LAYERS, n_embd=D, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS
    )
    attn = (3 * D * D + 3 * D) + (D * D + D)  # c_attn (q, k, v) and c_proj, with biases
    mlp = (D * 4 * D + 4 * D) + (4 * D * D + D)  # c_fc and c_proj
    layer = attn + mlp + 2 * 2 * D  # two layer norms (weight and bias)
    # the token table does the LM head's matmul (tied): it stays; the position table is looked up only
    return config, LAYERS * layer + 2 * D + VOCAB * D, POSITIONS * D


def llama() -> tuple[Any, int, int]:
    """Llama with grouped-query attention (4 heads, 2 KV heads) and an untied LM head."""
    inter, kv_heads, q = 688, 2, D // HEADS
    config = transformers.LlamaConfig(
        hidden_size=D, intermediate_size=inter, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=kv_heads, vocab_size=VOCAB,
    )  # fmt: skip
    attn = D * HEADS * q + 2 * D * kv_heads * q + HEADS * q * D  # q, k, v, o: no biases
    layer = attn + 3 * D * inter + 2 * D  # gate, up, down; two RMS norms
    return config, LAYERS * layer + D + VOCAB * D, VOCAB * D  # final norm, LM head; the token table


def counted(config: Any) -> tuple[torch.nn.Module, Profile]:
    """The model from ``config`` and the profile of one fwd+bwd of a causal LM loss."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on the config's token ids
        model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    tracer = CountingEngine(model)
    tracer.start()
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        tracer.stop()
    return model, tracer.profile()


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_the_6nd_row_is_six_times_the_non_embedding_params_times_tokens(make: Any) -> None:
    config, params, tables = make()
    model, profile = counted(config)
    assert profile.params == params + tables == sum(p.numel() for p in model.parameters())
    assert embedding_params(model) == tables
    rows = dict(estimate_rows(profile, TOKENS, config, model=model, samples=BATCH))
    measured = profile.model_flops
    six_nd = 6 * params * TOKENS
    assert rows["6 x non-embedding params x tokens"] == (
        f"{number_to_string(six_nd)}flops = 6 x {params_to_string(params)} x {TOKENS}, embedding tables left "
        f"out: {params_to_string(tables)} (measured fwd+bwd flops: {measured / six_nd:.2f}x this)"
    )
    assert attention_of(config) == Attention(LAYERS, HEADS, D // HEADS)
    attention = 12 * LAYERS * HEADS * (D // HEADS) * SEQ * TOKENS  # PaLM: 12 L H Q T a token
    palm = six_nd + attention
    assert rows["6 x non-embedding params x tokens + 12 x L x H x Q x T x tokens (PaLM)"] == (
        f"{number_to_string(palm)}flops = {number_to_string(six_nd)}flops + "
        f"{number_to_string(attention)}flops of attention, L={LAYERS}, H={HEADS}, Q={D // HEADS}, T={SEQ} "
        f"(measured fwd+bwd flops: "
        f"{measured / palm:.2f}x this)"
    )
    # Every matmul of the step is in 6N + attention (the weights' 2 forward + 4 backward flops per
    # token, QK^T and AV over the whole T x T matrix, as we count attention by default); what is
    # measured beyond it is the elementwise work (norms, activations, softmax, residual adds, the loss):
    # O(d) a token a layer against the matmuls' O(d^2). Measured here: 1.0036 (GPT-2), 1.0026 (Llama);
    # 1.0013 for a Llama 6 x 512. Without the attention term: 1.15 and 1.16; with every parameter in
    # N: 0.97 (GPT-2's position table) and 0.89 (Llama's token table).
    assert 1.0 < measured / palm < 1.01


def test_no_attention_term_without_the_sizes_or_one_sequence_length() -> None:
    config, _, _ = llama()
    model, profile = counted(config)
    labels = [label for label, _ in estimate_rows(profile, TOKENS, config, model=model)]
    assert labels == ["6 x non-embedding params x tokens"]  # samples unknown: no T
    labels = [label for label, _ in estimate_rows(profile, TOKENS - 1, config, model=model, samples=BATCH)]
    assert labels == ["6 x non-embedding params x tokens"]  # sequences of two lengths: no one T
    assert attention_of(transformers.T5Config()) is None  # encoder-decoder: not PaLM's one stack
    assert attention_of(transformers.GPT2Config(n_embd=100, n_head=3)) is None  # no whole head dim
    assert attention_of(transformers.GPT2Config()) == Attention(12, 12, 64)
    head_dim = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=128)
    assert attention_of(head_dim) == Attention(head_dim.num_hidden_layers, 4, 128)  # head_dim where set
