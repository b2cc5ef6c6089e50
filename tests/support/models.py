"""A tiny ``transformers`` Llama (nothing downloaded), for the tests that check folders against
``from_pretrained``. ``transformers`` is imported on call, so spawned ranks do not pay for it."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_llama"]


def tiny_llama(tie: bool = False, seed: int = 1234) -> Any:
    """A 2-layer Llama of hidden size 64 and 128 tokens, its weights drawn under ``seed``, in
    eval mode; ``tie``: ``tie_word_embeddings`` (``lm_head`` is the embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        attn_implementation="eager",  # one kernel on both sides of every logits comparison
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
