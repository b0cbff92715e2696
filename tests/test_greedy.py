"""Greedy TriForce is token-identical to our autoregressive decoding and to transformers' generate, on real
documents of different kinds and lengths (up to the embedded model's 8K context), for every drafter, with
repetition control on, and on a tiny random Qwen2-shaped model (the real presets' architecture)."""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from core import Engine, GenerationConfig
from core.events import Finished, PromptReady
from tests.tiny import tiny_config, tiny_pair

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
    return dataclasses.replace(embedded, draft=embedded.target, draft_name="self", memory=None)


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from core.io.loading import _cache_dir, embedded_source

    return AutoModelForCausalLM.from_pretrained(_cache_dir(embedded_source()), dtype=torch.float32).eval()


def run(engine, doc: str, instruction: str, **settings) -> tuple[Finished, PromptReady]:
    events = list(engine.generate(doc, instruction, GenerationConfig(greedy=True, **settings)))
    return events[-1], next(e for e in events if isinstance(e, PromptReady))


class OnAnswer(LogitsProcessor):
    """A transformers processor applied to the tokens after the prompt only."""

    def __init__(self, processor: LogitsProcessor, prompt_length: int):
        self.processor, self.prompt_length = processor, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.processor(input_ids[:, self.prompt_length:], scores)


def hf_processors(prompt_length: int, repetition_penalty: float, no_repeat_ngram_size: int) -> LogitsProcessorList:
    """transformers' processors for our repetition settings (over the answer, after the prompt)."""
    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty, prompt_ignore_length=prompt_length))
    if no_repeat_ngram_size:
        processors.append(OnAnswer(NoRepeatNGramLogitsProcessor(no_repeat_ngram_size), prompt_length))
    return processors


def hf_greedy(hf_model, prompt_ids: list[int], new: int, cfg: GenerationConfig) -> list[int]:
    """transformers' greedy answer under cfg's repetition settings."""
    processors = hf_processors(len(prompt_ids), cfg.repetition_penalty, cfg.no_repeat_ngram_size)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=new, do_sample=False,
                                logits_processor=processors)
    return out[0, len(prompt_ids):].tolist()


def test_a_run_ending_at_its_end_of_text_counts_the_forward_that_wrote_it(embedded):
    """The forward that wrote the end-of-text token counts its token: autoregressive decoding reads 1.00 tokens a
    forward, never 0.9, and method auto (here drafting a round, then autoregressive) never below it."""
    doc, question = "The dog sat on the log by the river.", "Where did the dog sit?"
    ar, _ = run(embedded, doc, question, method="ar", max_new_tokens=64)
    assert ar.stats.stop_reason == "eos" and ar.stats.target_forwards == len(ar.token_ids) + 1
    assert ar.stats.tokens_per_target_forward == 1.0
    auto, _ = run(embedded, doc, question, method="auto", max_new_tokens=64)
    assert auto.token_ids == ar.token_ids and auto.stats.tokens_per_target_forward >= 1.0


@pytest.mark.parametrize("name,instruction,new", CASES)
def test_greedy_triforce_equals_ar_and_transformers(engine, hf_model, name, instruction, new):
    doc = (DOCS / name).read_text()
    common = dict(max_new_tokens=new, budget=512, chunk_size=8, gamma1=3, gamma2=5)
    ar, ready = run(engine, doc, instruction, method="ar", **common)
    assert ready.prompt_tokens > 2000 and len(ar.token_ids) >= 8
    hf_ids = hf_greedy(hf_model, ar.prompt_ids, new, GenerationConfig())  # the default repetition settings
    assert hf_ids[:len(ar.token_ids)] == ar.token_ids
    assert set(hf_ids[len(ar.token_ids):]) <= engine.target.eos_ids
    for drafter, reselect in (("model", "once"), ("ngram", "every_verify"), ("none", 2)):
        tf, _ = run(engine, doc, instruction, method="triforce", drafter=drafter, reselect=reselect, **common)
        assert tf.token_ids == ar.token_ids, f"drafter {drafter} diverged from AR"
        assert tf.prompt_ids == ar.prompt_ids
        assert tf.stats.target_forwards < len(tf.token_ids)  # several tokens per full-cache forward


@pytest.mark.parametrize("control", [{"repetition_penalty": 1.0, "no_repeat_ngram_size": 3},
                                     {"repetition_penalty": 1.3, "no_repeat_ngram_size": 4}])
def test_greedy_with_repetition_control_equals_ar_and_transformers(engine, hf_model, control):
    """No repeated 3-gram (the plain answer, checked with the controls off above, says "the King of" twice in 32
    tokens, and loops on it later), and both rules: every level verifies against the same processed target."""
    name, instruction, new = CASES[0]
    doc = (DOCS / name).read_text()
    common = dict(max_new_tokens=new, budget=512, chunk_size=8, gamma1=3, gamma2=5, **control)
    ar, _ = run(engine, doc, instruction, method="ar", **common)
    assert hf_greedy(hf_model, ar.prompt_ids, new, GenerationConfig(**control))[:len(ar.token_ids)] == ar.token_ids
    tf, _ = run(engine, doc, instruction, method="triforce", drafter="model", **common)
    assert tf.token_ids == ar.token_ids


def test_greedy_triforce_equals_ar_on_a_tiny_qwen2_with_biases_and_tied_embeddings(embedded, one_thread):
    """The real presets' architecture in small (Qwen2: q/k/v biases, GQA, the LM head tied to the embedding), random
    weights over the embedded tokenizer's vocabulary, level 1 a second such model or prompt lookup."""
    config = tiny_config("qwen2", vocab=len(embedded.tokenizer), layers=2, max_position=4096, tie_word_embeddings=True)
    hf, target = tiny_pair(config, seed=0, scale=4.0, biases=0.5)
    _, draft = tiny_pair(config, seed=1, scale=4.0, biases=0.5)
    assert target.lm_head.weight is target.embed_tokens.weight and target.layers[0].self_attn.k_proj.bias.abs().sum()
    for model in (target, draft):
        model.eos_ids = set()  # random weights: run to the token limit
        model.requires_grad_(False)  # as loaded models are
    engine = Engine.from_models(target, embedded.tokenizer, "tiny-qwen2", draft, "tiny-qwen2-draft")
    doc = (DOCS / CASES[1][0]).read_text()[:6000]
    common = dict(max_new_tokens=24, budget=64, chunk_size=8, gamma1=2, gamma2=4)
    ar, ready = run(engine, doc, "Explain.", method="ar", **common)
    assert ready.prompt_tokens > 1000 and len(ar.token_ids) == 24
    assert hf_greedy(hf, ar.prompt_ids, 24, GenerationConfig()) == ar.token_ids
    for drafter in ("model", "ngram"):
        tf, _ = run(engine, doc, "Explain.", method="triforce", drafter=drafter, **common)
        assert tf.token_ids == ar.token_ids, f"drafter {drafter} diverged from AR"
