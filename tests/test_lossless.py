"""The whole hierarchy (level-1 model draft, level-2 retrieval, level-3 full) emits exactly the target's
distribution; the same test fails when level 2 resamples from its own p instead of the residual (the reference
code's bias)."""

import os
import time
from collections import Counter
from typing import Sequence

import torch
from transformers.generation.logits_process import LogitsProcessor, RepetitionPenaltyLogitsProcessor

import core.drafters
import core.triforce
from core.config import GenerationConfig
from core.engine import Engine
from core.events import Finished
from core.kvcache import KVCache
from core.prompting import Prompt
from core.repetition import Repetition
from core.sampling import distributions
from tests.stats import chi_square_p
from tests.tiny import tiny_config, tiny_pair

VOCAB = 10
DEVICE = os.environ.get("TRIFORCE_TEST_DEVICE", "cpu")  # "cuda": the same test through the GPU kernels and graphs
DRAWS = 10000  # exact sampler: enough to see a small bias
BIASED_DRAWS = 3000
GATED_DRAWS = 4000  # the reference code's bias is large (total variation ~0.07 here)


class DigitTokenizer:
    """Stands in for a tokenizer: the tiny models' ids are shown as digits."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def tiny_engine(target_seed: int = 0) -> tuple[Engine, list[int]]:
    """Tiny target and draft models with a 48-token prompt."""
    _, target = tiny_pair(tiny_config(vocab=VOCAB, layers=1), seed=target_seed, scale=4.0)
    _, draft = tiny_pair(tiny_config(vocab=VOCAB, layers=1), seed=1, scale=4.0)
    target, draft = target.to(DEVICE), draft.to(DEVICE)
    target.eos_ids = set()
    prompt = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    return Engine.from_models(target, DigitTokenizer(), "tiny", draft, "tiny-draft", 256), prompt  # graphs on CUDA


CFG = dict(method="triforce", max_new_tokens=2, budget=8, chunk_size=4, gamma1=2, gamma2=3, drafter="model",
           temperature=1.0, top_p=1.0, sink_tokens=4, window_tokens=12, reselect="every_verify",
           repetition_penalty=1.0)  # the target's own distribution (one test turns the penalty on)


def emitted_pairs(engine: Engine, prompt: list[int], draws: int, **extra) -> tuple[Counter, dict]:
    """Counts of the first two emitted tokens over `draws` seeds, and acceptance counters summed over the runs."""
    counts, levels = Counter(), Counter()
    for seed in range(draws):
        cfg = GenerationConfig(**{**CFG, **extra}, seed=seed).validate()
        finished = [e for e in engine._run(Prompt(prompt, len(prompt), 0), cfg) if isinstance(e, Finished)][0]
        counts[tuple(finished.token_ids)] += 1
        levels["l1_proposed"] += finished.stats.level1_proposed
        levels["l1_accepted"] += finished.stats.level1_accepted
        levels["l2_proposed"] += finished.stats.level2_proposed
        levels["l2_accepted"] += finished.stats.level2_accepted
    return counts, levels


def target_pairs(engine: Engine, prompt: list[int], processors: Sequence[LogitsProcessor] = ()) -> dict:
    """Exact probability of each first two tokens under the target with the full context, its logits put through
    transformers' `processors` first."""
    cfg = GenerationConfig(**CFG)
    m = engine.target

    def dist(seq):
        a = m.args
        cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, len(seq), torch.float32, m.device)
        logits = m(torch.tensor(seq, device=m.device), cache, 1)
        for processor in processors:
            logits = processor(torch.tensor([seq], device=m.device), logits)
        return distributions(logits, cfg)[0]

    first = dist(prompt)
    return {(a, b): float(first[a]) * float(pb) for a in range(VOCAB) for b, pb in enumerate(dist(prompt + [a]))}



def test_hierarchy_is_lossless_and_detects_level2_bias(monkeypatch, one_thread):
    engine, prompt = tiny_engine()
    with torch.no_grad():
        expected = target_pairs(engine, prompt)
        t0 = time.perf_counter()
        counts, levels = emitted_pairs(engine, prompt, DRAWS)
        elapsed = time.perf_counter() - t0
    # both levels must really be at work: level 1 proposes and is sometimes rejected, level 2 likewise
    assert 0 < levels["l1_accepted"] < levels["l1_proposed"]
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"]
    p_ok = chi_square_p(counts, expected, DRAWS)
    assert p_ok > 1e-3, f"exact sampler rejected (p={p_ok:.2e}, {elapsed:.0f}s)"

    monkeypatch.setattr(core.triforce, "residual_distribution", lambda p, q: p)
    with torch.no_grad():
        biased, _ = emitted_pairs(engine, prompt, BIASED_DRAWS)
    p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
    assert p_biased < 1e-6, f"level-2 bias not detected (p={p_biased:.2e})"


def test_repetition_penalty_is_lossless_and_row_histories_matter(monkeypatch, one_thread):
    """With a repetition penalty every level verifies against the penalised target: the hierarchy emits the target's
    distribution as transformers' processor penalises it (the answer's tokens); the same test fails when each row of
    a verification is penalised with the first row's history (not seeing the draft tokens before it)."""
    engine, prompt = tiny_engine(target_seed=33)  # a target that repeats its first token half the time
    penalty = 1.5
    processor = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=len(prompt))
    with torch.no_grad():
        plain = target_pairs(engine, prompt)
        expected = target_pairs(engine, prompt, [processor])
        assert sum(abs(expected[k] - plain[k]) for k in plain) / 2 > 0.2  # the penalty really changes the target
        counts, levels = emitted_pairs(engine, prompt, GATED_DRAWS, repetition_penalty=penalty)
    assert 0 < levels["l1_accepted"] < levels["l1_proposed"]
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"]
    p_ok = chi_square_p(counts, expected, GATED_DRAWS)
    assert p_ok > 1e-3, f"penalised sampler rejected (p={p_ok:.2e})"

    original = Repetition.__call__

    def first_row_history(self, logits, seq, extra=(), columns=None):
        common = list(extra)[:len(extra) - logits.shape[0] + 1]
        return torch.cat([original(self, row[None], seq, common, columns) for row in logits])

    monkeypatch.setattr(Repetition, "__call__", first_row_history)
    with torch.no_grad():
        biased, _ = emitted_pairs(engine, prompt, BIASED_DRAWS, repetition_penalty=penalty)
    p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
    assert p_biased < 1e-6, f"row-history bias not detected (p={p_biased:.2e})"
