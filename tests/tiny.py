"""Tiny random transformers models (and our copy of each) for fast tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from core.model.transformer import Transformer

CONFIGS = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


class DigitTokenizer:
    """Stands in for a tokenizer: the tiny models' ids are shown as digits."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def tiny_config(model_type: str = "llama", vocab: int = 96, rope: dict | None = None, layers: int = 2,
                max_position: int = 256, **extra):
    """A small config of the given family: 4 query heads over 2 KV heads (GQA), untied embeddings unless `extra`
    says otherwise."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, **(rope or {})}
    return CONFIGS[model_type](vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=max_position, rope_parameters=rope,
                               **{"tie_word_embeddings": False, **extra})


def tiny_pair(config, seed: int = 0, scale: float = 1.0, biases: float = 0.0):
    """A random transformers model and our Transformer holding the same weights (float32, eval); `biases`: the scale
    of random biases (transformers initialises them to zero)."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # wider weights than the default init: peakier, more distinct
            p.mul_(scale)
            if biases and name.endswith(".bias"):
                p.normal_(0.0, biases)
    ours = Transformer(hf.config)
    ours.load_hf_state_dict({k: v.clone() for k, v in hf.state_dict().items()})
    return hf, ours.eval()
