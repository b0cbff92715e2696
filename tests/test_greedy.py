"""Greedy TriForce is token-identical to our autoregressive decoding and to transformers' generate, on real
documents of different kinds and lengths (up to the embedded model's 8K context), for every drafter."""

import dataclasses
from pathlib import Path

import pytest
import torch

from core import GenerationConfig
from core.events import Finished, PromptReady

DOCS = Path(__file__).parent.parent / "assets" / "docs"
CASES = [
    ("us_declaration_of_independence.txt", "What does the document say about the King? Answer in two sentences.",
     32),
    ("python_socket_programming_howto.txt", "Explain what a server socket does.", 24),
    ("gpl-3.0.txt", "Summarise the conditions for conveying modified source versions.", 16),
]


@pytest.fixture(scope="module")
def engine(embedded):
    """The embedded engine with the target itself as level-1 draft model (no separate draft ships yet)."""
    return dataclasses.replace(embedded, draft=embedded.target, draft_name="self", _prefilled=None)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from core.loading import _cache_dir, embedded_source

    return AutoModelForCausalLM.from_pretrained(_cache_dir(embedded_source()), dtype=torch.float32).eval()


def run(engine, doc: str, instruction: str, **settings) -> tuple[Finished, PromptReady]:
    events = list(engine.generate(doc, instruction, GenerationConfig(greedy=True, **settings)))
    return events[-1], next(e for e in events if isinstance(e, PromptReady))


@pytest.mark.parametrize("name,instruction,new", CASES)
def test_greedy_triforce_equals_ar_and_transformers(engine, hf_model, name, instruction, new):
    doc = (DOCS / name).read_text()
    common = dict(max_new_tokens=new, budget=512, chunk_size=8, gamma1=3, gamma2=5)
    ar, ready = run(engine, doc, instruction, method="ar", **common)
    assert ready.prompt_tokens > 2000 and len(ar.token_ids) >= 8
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([ar.prompt_ids]), max_new_tokens=new, do_sample=False)
    hf_ids = hf[0, len(ar.prompt_ids):].tolist()
    assert hf_ids[:len(ar.token_ids)] == ar.token_ids
    assert set(hf_ids[len(ar.token_ids):]) <= engine.target.eos_ids
    for drafter, reselect in (("model", "once"), ("ngram", "every_verify"), ("none", 2)):
        tf, _ = run(engine, doc, instruction, method="triforce", drafter=drafter, reselect=reselect, **common)
        assert tf.token_ids == ar.token_ids, f"drafter {drafter} diverged from AR"
        assert tf.prompt_ids == ar.prompt_ids
        assert tf.stats.target_forwards < len(tf.token_ids)  # several tokens per full-cache forward
