"""What the lossless tests share: a tiny target and draft over a 10-token vocabulary, the exact distribution of the
target's first two tokens, and the counts a sampler emits over many seeds (tests/stats.py compares the two)."""

import os
from collections import Counter
from typing import Sequence

import torch
from transformers.generation.logits_process import LogitsProcessor

from core.config import GenerationConfig
from core.engine import Engine
from core.events import Finished
from core.cache.kvcache import KVCache
from core.decode.sampling import distributions
from tests.tiny import DigitTokenizer, tiny_config, tiny_pair

VOCAB = 10
DEVICE = os.environ.get("TRIFORCE_TEST_DEVICE", "cpu")  # "cuda": the same test through the GPU kernels and graphs
DRAWS = 10000  # exact sampler: enough to see a small bias
BIASED_DRAWS = 3000
GATED_DRAWS = 4000  # the reference code's bias is large (total variation ~0.07 here)


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
    """Counts of the emitted tokens (max_new_tokens of them: two unless `extra` says) over `draws` seeds, and
    acceptance and drafting-ahead counters summed over the runs."""
    counts, levels = Counter(), Counter()
    for seed in range(draws):
        cfg = GenerationConfig(**{**CFG, **extra}, seed=seed).validate()
        finished = [e for e in engine.generate_ids(prompt, cfg) if isinstance(e, Finished)][0]
        counts[tuple(finished.token_ids)] += 1
        levels["l1_proposed"] += finished.stats.level1_proposed
        levels["l1_accepted"] += finished.stats.level1_accepted
        levels["l2_proposed"] += finished.stats.level2_proposed
        levels["l2_accepted"] += finished.stats.level2_accepted
        levels["ahead_made"] += finished.stats.ahead_made
        levels["ahead_kept"] += finished.stats.ahead_kept
    return counts, levels


def target_pairs(engine: Engine, prompt: list[int], processors: Sequence[LogitsProcessor] = (), length: int = 2
                 ) -> dict:
    """Exact probability of each sequence of the first `length` tokens under the target with the full context, its
    logits put through transformers' `processors` first."""
    cfg = GenerationConfig(**CFG)
    m = engine.target

    def dist(seq):
        a = m.args
        cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, len(seq), torch.float32, m.device)
        logits = m(torch.tensor(seq, device=m.device), cache, 1)
        for processor in processors:
            logits = processor(torch.tensor([seq], device=m.device), logits)
        return distributions(logits, cfg)[0]

    probs = {(): 1.0}
    for _ in range(length):
        probs = {(*seq, x): p * float(px) for seq, p in probs.items() for x, px in enumerate(dist(prompt + list(seq)))}
    return probs
