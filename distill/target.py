"""The target being distilled: transformers' model (it samples the answers) and the same weights as a frozen
core.model.transformer.Transformer (the soft labels and the draft's shared layers)."""

from __future__ import annotations

import torch


def load_hf(source, dev):
    """The target as transformers' model (for generate), its source, tokenizer and eos ids."""
    from core.io.loading import _eos_ids, _from_pretrained, resolve
    src = resolve(source)
    tok, hf = _from_pretrained(src, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    hf = hf.to(dev).eval()
    return src, tok, hf, _eos_ids(hf, tok)


def as_transformer(hf):
    """The same weights as a frozen core.model.transformer.Transformer (its causal_states and the shared draft layers)."""
    from core.model.transformer import Transformer
    with torch.device("meta"):
        target = Transformer(hf.config)
    target.load_hf_state_dict(hf.state_dict())
    return target.to(hf.device, hf.dtype).eval().requires_grad_(False)
