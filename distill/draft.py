"""The draft being trained: built from the target's layers (the first ones shared), given a fusion module, or
resumed from a draft directory."""

from __future__ import annotations

from pathlib import Path

import torch

from core.io.draftdir import read_draft


def make_draft(target, layers: list[int], shared: int = 0):
    """A Transformer whose first `shared` layers ARE the target's (frozen, not stored), followed by own layers
    copied from the target's `layers`, the target's final norm and the target's embedding and LM head."""
    import copy

    from core.model.transformer import Transformer
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = shared + len(layers)
    draft = Transformer(config)
    for i, j in enumerate(layers):
        draft.layers[shared + i].load_state_dict(target.layers[j].state_dict())
    draft.norm.load_state_dict(target.norm.state_dict())
    draft = draft.float().to(target.device)
    for i in range(shared):
        draft.layers[i] = target.layers[i]
    draft.embed_tokens = target.embed_tokens  # shared and frozen
    draft.lm_head = target.lm_head
    return draft


def own_parameters(draft, shared: int) -> dict[str, torch.nn.Parameter]:
    """The draft's own weights (trained and stored): all but the embedding, LM head and the shared layers."""
    skip = ("embed_tokens", "lm_head", *(f"layers.{i}." for i in range(shared)))
    return {k: v for k, v in draft.named_parameters() if not k.startswith(skip)}


def add_fusion(draft, hidden: int, ages: int):
    """Give a draft a fusion module that leaves it as it is until trained (zero output projection)."""
    from core.model.transformer import Fusion
    draft.fusion = Fusion(draft.args.dim, hidden, ages).to(draft.device)
    torch.nn.init.zeros_(draft.fusion.down.weight)
    torch.nn.init.normal_(draft.fusion.age.weight, std=0.02)
    return draft


def ages(draft) -> int:
    """How many ages of the target's hidden state a draft's fusion module knows (0: no fusion module)."""
    return draft.fusion.age.num_embeddings if draft.fusion is not None else 0


def resumed(target, directory: Path) -> tuple[object, int, list[int], torch.Tensor]:
    """A draft saved by train (own layers and any fusion module from its files, int8 made whole) to go on training,
    its shared count, the target layers its own layers were initialised from, and its head ids."""
    _, meta, state, head_ids = read_draft(directory)
    draft = make_draft(target, meta["init_layers"], meta["shared_layers"])
    if fusion := meta.get("fusion"):
        add_fusion(draft, fusion["hidden"], fusion["ages"])
    missing, unexpected = draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or any(k in missing for k in own_parameters(draft, meta["shared_layers"])):
        raise ValueError(f"{directory}: weights do not fit a draft of its config")
    return draft, meta["shared_layers"], meta["init_layers"], head_ids
