"""A distilled draft's directory (assets/draft, written by `python -m distill train`): config.json, a transformers
config with a `triforce_draft` block of metadata; model.safetensors, the draft's own weights (bf16, or matrices as
int8 rows and a bf16 `.scale` per row); head_vocab.safetensors, the token ids its reduced LM head scores. The one
writer and the one reader of that format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig

WEIGHTS_FILE = "model.safetensors"
HEAD_FILE = "head_vocab.safetensors"


class DraftFiles(NamedTuple):
    """What a draft directory holds, read back."""

    config: PretrainedConfig
    meta: dict
    state: dict[str, torch.Tensor]
    head_ids: torch.Tensor | None


def draft_meta(directory: Path) -> dict | None:
    """The triforce_draft block of a directory's config.json; None for anything else (a checkpoint, a hub id)."""
    config_file = directory / "config.json"
    return json.loads(config_file.read_text()).get("triforce_draft") if config_file.is_file() else None


def write_draft(directory: Path, config: dict, meta: dict, state: dict[str, torch.Tensor],
                head_ids: torch.Tensor) -> None:
    """Store a draft: `config` (a transformers config as a dict) with `meta` as its triforce_draft block (its
    head_vocab gets the head file's name), the own weights `state` (matrices as int8 rows + a bf16 scale per row
    where meta["int8"], else bf16) and the head ids."""
    stored = {}
    for k, v in state.items():
        v = v.detach().float().contiguous()
        if meta["int8"] and v.dim() == 2:  # half the size: more layers under the 20 MB limit
            scale = (v.abs().amax(1, keepdim=True) / 127).clamp_min(1e-8).to(torch.bfloat16)
            # stored weights re-stored unchanged give the same bytes (a fusion run leaves the body as it was)
            stored[k], stored[k + ".scale"] = (v / scale.float()).round().clamp(-127, 127).to(torch.int8), scale
        else:
            stored[k] = v.to(torch.bfloat16)
    save_file(stored, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    save_file({"ids": head_ids.cpu()}, directory / HEAD_FILE)
    meta = {**meta, "head_vocab": {"file": HEAD_FILE, **meta["head_vocab"]}}
    (directory / "config.json").write_text(json.dumps({**config, "triforce_draft": meta}, indent=2) + "\n")


def read_draft(directory: Path) -> DraftFiles:
    """A draft directory's config, metadata, own weights (int8 rows times their scale made whole again, exactly, in
    float32; the rest as stored) and head ids (None without a reduced head)."""
    meta = draft_meta(directory)
    if not meta:
        raise ValueError(f"{directory}: not a draft directory (its config.json has no triforce_draft block)")
    state = load_file(directory / WEIGHTS_FILE)
    for k in [k for k in state if k.endswith(".scale")]:
        scale = state.pop(k)
        state[k.removesuffix(".scale")] = state[k.removesuffix(".scale")].float() * scale.float()
    head = meta.get("head_vocab")
    head_ids = load_file(directory / head["file"])["ids"] if head else None
    return DraftFiles(AutoConfig.from_pretrained(directory, trust_remote_code=False), meta, state, head_ids)
