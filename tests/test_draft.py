"""The level-1 draft shipped in assets/draft: loaded by default with the embedded target, small, sharing the
target's embedding and the rows of its LM head it scores, refused for another tokenizer, and lossless (greedy
TriForce == AR)."""

import json
from pathlib import Path

import pytest
import torch

from core import GenerationConfig
from core.config import TokenizerMismatchError
from core.io.draftdir import HEAD_FILE, read_draft, write_draft
from core.events import DraftProposal, Finished, Tokens
from core.io.loading import DRAFT_DIR, load_draft

DOC = Path(__file__).parent.parent / "assets" / "docs" / "us_declaration_of_independence.txt"


def test_shipped_draft_is_loaded_small_and_shares_the_embedding(embedded):
    draft, target = embedded.draft, embedded.target
    assert draft is not None and "draft" in embedded.info["draft"]
    assert draft.embed_tokens is target.embed_tokens
    head = json.loads((DRAFT_DIR / "config.json").read_text())["triforce_draft"]["head_vocab"]
    ids = draft.vocab_ids  # a reduced head: the target's own rows for the most frequent tokens (and the specials)
    assert len(ids) == head["size"] < target.args.vocab_size and set(embedded.target.eos_ids) <= set(ids.tolist())
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[ids])
    assert len(draft.layers) < len(target.layers) and draft.args.dim == target.args.dim
    assert draft.fusion is not None and "fused" in embedded.info["draft"]
    assert sum(f.stat().st_size for f in DRAFT_DIR.iterdir()) < 20e6


def test_draft_for_another_tokenizer_is_refused(embedded, tmp_path):
    config = json.loads((DRAFT_DIR / "config.json").read_text())
    config["triforce_draft"]["vocab_sha256"] = "0" * 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(DRAFT_DIR / "model.safetensors")
    with pytest.raises(TokenizerMismatchError):
        load_draft(str(tmp_path), embedded.target, embedded.tokenizer, "target", embedded.target.device,
                   embedded.target.dtype)


def test_greedy_triforce_with_the_draft_equals_ar(embedded):
    """Also with copies from the text: the answer quotes the document, and copied tokens are marked as such."""
    doc = DOC.read_text()[:3000]
    common = dict(greedy=True, max_new_tokens=24, budget=256, gamma1=2, gamma2=6)
    runs, provenance = {}, {}
    for method, drafter in (("ar", "auto"), ("triforce", "model")):
        cfg = GenerationConfig(method=method, drafter=drafter, **common)
        events = list(embedded.generate(doc, "Quote the first sentence of the document.", cfg))
        runs[method] = next(e for e in events if isinstance(e, Finished))
        provenance[method] = [p for e in events if isinstance(e, Tokens) for p in e.provenance]
        copied = [c for e in events if isinstance(e, DraftProposal) for c in e.copied]
    assert runs["triforce"].token_ids == runs["ar"].token_ids
    assert runs["triforce"].stats.level1_proposed > 0
    assert {"copy", "draft"} <= set(provenance["triforce"]) and any(copied) and not all(copied)


def test_fusion_changes_what_the_draft_proposes_not_the_answer(embedded):
    """Greedy, with and without the target's hidden states: the same answer (AR's), other proposals."""
    doc = DOC.read_text()[:3000]
    runs = {}
    for fusion in (True, False):
        cfg = GenerationConfig(method="triforce", greedy=True, max_new_tokens=24, budget=256, lookup_min=0,
                               draft_fusion=fusion)
        events = list(embedded.generate(doc, "What does the document say about the King?", cfg))
        runs[fusion] = (next(e for e in events if isinstance(e, Finished)).token_ids,
                        [e.tokens for e in events if isinstance(e, DraftProposal)])
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] != runs[False][1]


def test_int8_draft_is_dequantised_and_shares_the_target_layers(embedded):
    from safetensors.torch import load_file

    draft, target = embedded.draft, embedded.target
    shared = json.loads((DRAFT_DIR / "config.json").read_text())["triforce_draft"]["shared_layers"]
    assert shared > 0 and all(draft.layers[i] is target.layers[i] for i in range(shared))  # used, not copied
    stored = load_file(DRAFT_DIR / "model.safetensors")
    assert not any(k.startswith(f"layers.{i}.") for k in stored for i in range(shared))
    params = dict(draft.named_parameters())
    for k in [k for k in stored if k.endswith(".scale")]:  # int8 rows x a bf16 scale per row (distill train --int8)
        w = k.removesuffix(".scale")
        assert stored[w].dtype == torch.int8
        expected = (stored[w].float() * stored[k].float()).to(params[w].dtype)  # exact, in float32
        assert torch.equal(params[w], expected)


def test_draft_file_never_overwrites_shared_target_layers(embedded, tmp_path):
    from safetensors.torch import load_file, save_file

    stored = load_file(DRAFT_DIR / "model.safetensors")
    stored["layers.0.mlp.up_proj.weight"] = embedded.target.layers[0].mlp.up_proj.weight.detach().clone()
    save_file(stored, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((DRAFT_DIR / "config.json").read_text())
    (tmp_path / HEAD_FILE).symlink_to(DRAFT_DIR / HEAD_FILE)
    with pytest.raises(ValueError, match="do not fit"):
        load_draft(str(tmp_path), embedded.target, embedded.tokenizer, "target", embedded.target.device,
                   embedded.target.dtype)


def test_draft_directory_round_trip(tmp_path):
    """write_draft stores matrices as int8 rows + a scale where the metadata says int8, the rest as bf16; read_draft
    gives them back whole, with the config, the metadata (naming the head file) and the head ids."""
    config = json.loads((DRAFT_DIR / "config.json").read_text())
    meta = {**config.pop("triforce_draft"), "int8": True, "head_vocab": {"size": 3}}
    state = {"norm.weight": torch.randn(8), "layers.4.mlp.up_proj.weight": torch.randn(4, 8)}
    write_draft(tmp_path, config, meta, state, torch.tensor([0, 5, 7]))
    back = read_draft(tmp_path)
    assert back.meta == {**meta, "head_vocab": {"file": HEAD_FILE, "size": 3}} and back.head_ids.tolist() == [0, 5, 7]
    assert back.config.num_hidden_layers == config["num_hidden_layers"] and set(back.state) == set(state)
    assert torch.equal(back.state["norm.weight"], state["norm.weight"].bfloat16())
    w = state["layers.4.mlp.up_proj.weight"]
    assert back.state["layers.4.mlp.up_proj.weight"].dtype == torch.float32
    assert torch.allclose(back.state["layers.4.mlp.up_proj.weight"], w, atol=w.abs().max().item() / 100)
