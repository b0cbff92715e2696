"""Retrieval selection equals a brute-force reference; the streaming ablation keeps the sink and the most recent
chunks; a budget covering the prompt equals full attention."""

import pytest
import torch

from core.config import GenerationConfig
from core.cache.kvcache import KVCache
from core.cache.memory import retrieval_cache
from core.cache.retrieval import (LEVEL2_CACHES, ChunkIndex, chunks_to_keep, gather_selection,
                                  select_chunks)

LAYERS, HQ, HKV, D = 3, 6, 2, 8


def filled_cache(length: int, seed: int) -> tuple[KVCache, torch.Tensor]:
    """A full cache holding `length` random tokens, and the raw queries [L, Hq, D] of a next token."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(LAYERS, HKV, D, length + 1, torch.float32, "cpu")
    cache.k[:, :, :length] = torch.randn(LAYERS, HKV, length, D, generator=g)
    cache.v[:, :, :length] = torch.randn(LAYERS, HKV, length, D, generator=g)
    cache.used = length
    return cache, torch.randn(LAYERS, HQ, D, generator=g)


def brute_force(cache: KVCache, q: torch.Tensor, length: int, cs: int, n_select: int) -> list:
    """Per layer and KV head: score every full chunk by the group's summed q . mean key; chunk 0 forced."""
    group = HQ // HKV
    out = []
    for layer in range(LAYERS):
        heads = []
        for h in range(HKV):
            scores = []
            for c in range(length // cs):
                mean = cache.k[layer, h, c * cs:(c + 1) * cs].mean(0)
                scores.append(sum(float(q[layer, h * group + j] @ mean) for j in range(group)))
            order = sorted(range(1, len(scores)), key=lambda c: -scores[c])
            heads.append(sorted([0] + order[:n_select - 1]))
        out.append(heads)
    return out


@pytest.mark.parametrize("length,cs,budget", [(203, 8, 64), (96, 4, 20), (57, 5, 15), (40, 8, 400)])
def test_selection_matches_brute_force(length, cs, budget):
    cache, q = filled_cache(length, seed=length)
    index = ChunkIndex.build(cache, length, cs)
    assert index.num_chunks == length // cs and index.tail == length % cs
    n_select = chunks_to_keep(index.num_chunks, budget, index.chunk_size)
    assert n_select == min(budget // cs, length // cs)
    ids = select_chunks(index, q.view(LAYERS, HKV, HQ // HKV, D).sum(2), n_select)  # a GQA group's summed queries
    assert ids.tolist() == brute_force(cache, q, length, cs, n_select)

    retrieval = retrieval_cache(cache, index, budget, extra=4)
    gather_selection(cache, index, ids, retrieval)
    for layer in range(LAYERS):
        for h in range(HKV):
            tokens = [c * cs + i for c in ids[layer, h].tolist() for i in range(cs)]
            tokens += list(range(length - index.tail, length))
            assert retrieval.head == len(tokens)
            torch.testing.assert_close(retrieval.k[layer, h, :len(tokens)], cache.k[layer, h, tokens])
            torch.testing.assert_close(retrieval.v[layer, h, :len(tokens)], cache.v[layer, h, tokens])


def test_streaming_keeps_sink_and_recent_chunks():
    cache, q = filled_cache(203, seed=1)
    index = ChunkIndex.build(cache, 203, 8)  # 25 chunks and a tail of 3 tokens (kept apart, as for retrieval)
    select = LEVEL2_CACHES["streaming"](GenerationConfig(sink_tokens=12, chunk_size=8))  # 12 tokens: 2 chunks
    queries = q.view(LAYERS, HKV, HQ // HKV, D).sum(2)
    assert select(index, queries, 10).tolist() == [[[0, 1, *range(17, 25)]] * HKV] * LAYERS
    assert select(index, queries, 25).tolist() == [[list(range(25))] * HKV] * LAYERS
    assert select(index, queries, 1).tolist() == [[[0]] * HKV] * LAYERS


def test_budget_covering_prompt_equals_full_attention():
    from core.decode.levels import Level
    from tests.tiny import tiny_config, tiny_pair

    _, model = tiny_pair(tiny_config())
    prompt = torch.randint(0, 96, (61,), generator=torch.Generator().manual_seed(3)).tolist()
    a = model.args
    full = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 80, torch.float32, "cpu")
    target = Level(model, full, [])
    with torch.no_grad():
        list(target.prefill(prompt[:-1], 16, record=1))
        index = ChunkIndex.build(full, len(prompt) - 1, 8)
        retrieval = retrieval_cache(full, index, 4096, extra=8)
        n_select = chunks_to_keep(index.num_chunks, 4096, index.chunk_size)
        ids = select_chunks(index, torch.stack([q[:, -1] for q in target.queries]), n_select)
        gather_selection(full, index, ids, retrieval)
        level2 = Level(model, retrieval, prompt[:-1])
        seq = prompt + [5, 7, 9]
        torch.testing.assert_close(level2.logits(seq, 4), target.logits(seq, 4), atol=1e-5, rtol=1e-5)
