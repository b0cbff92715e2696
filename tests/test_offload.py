"""KV offloading: the full cache in host memory, streamed layer by layer (on a CPU "device" the same code path as on a
GPU with copies synchronous; TRIFORCE_TEST_DEVICE=cuda runs it with page-locked memory and a copy stream) gives the
same logits, the same greedy tokens and the same sampled distribution; the placement plan offloads only when the
device budget is exceeded and refuses clearly."""

import pytest
import torch

from core.config import GenerationConfig, TriForceError
from core.engine import Engine
from core.events import Finished, PlanChosen, PromptReady, StepTiming, Verdict
from core.cache.kvcache import KVCache
from core.decode.levels import Level
from core.cache import offload
from core.cache.offload import OffloadedKVCache
from core.cache.memory import GiB, Memory
from core.cache.memory import retrieval_cache
from core.cache.retrieval import ChunkIndex, chunks_to_keep, gather_selection, select_chunks
from tests.stats import chi_square_p
from tests.lossless import DEVICE, emitted_pairs, target_pairs, tiny_engine
from tests.tiny import DigitTokenizer, tiny_config, tiny_pair

PROMPT = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(5)).tolist()


def test_streamed_cache_computes_what_the_resident_one_does():
    """Prefill, a decode step, a verification after a rollback, the chunk index and the gather: bit-identical."""
    _, model = tiny_pair(tiny_config(layers=3))
    model = model.to(DEVICE)
    a = model.args
    results = []
    for cls in (KVCache, OffloadedKVCache):
        full = cls(a.n_layers, a.n_kv_heads, a.head_dim, 200, torch.float32, DEVICE)
        level = Level(model, full, [])
        with torch.no_grad():
            list(level.prefill(PROMPT[:-1], 32, record=1))
            queries = torch.stack([q[:, -1] for q in level.queries])
            seq = PROMPT + [5, 7, 9]
            first = level.logits(seq, 4)
            rolled = level.logits(seq[:-1] + [11, 12], 3, len(PROMPT))
            index = ChunkIndex.build(full, len(PROMPT) - 1, 8)
            into = retrieval_cache(full, index, 64, 8)
            kept = chunks_to_keep(index.num_chunks, 64, index.chunk_size)
            gather_selection(full, index, select_chunks(index, queries, kept), into)
        results.append((first, rolled, index.mean_keys, into.k[:, :, :into.head], into.v[:, :, :into.head]))
    for resident, streamed in zip(*results):
        assert torch.equal(resident, streamed)


def test_the_host_copy_stays_the_resident_cache_while_steps_send_whole_blocks_back(monkeypatch):
    """With 16-row blocks: a prefill, 40 decode steps across blocks up to the cache's capacity, a rollback and a
    verification leave the host storage equal to a resident cache's, and each step says which rows it copied back
    (what its CUDA graph bakes in): two blocks from the start of the one its first new token falls in."""
    monkeypatch.setattr(offload, "BLOCK", 16)
    _, model = tiny_pair(tiny_config(layers=2))
    model = model.to(DEVICE)
    a = model.args
    caches, layouts = [], set()
    for cls in (KVCache, OffloadedKVCache):
        full = cls(a.n_layers, a.n_kv_heads, a.head_dim, 200, torch.float32, DEVICE)
        level, seq = Level(model, full, []), list(PROMPT)
        with torch.no_grad():
            list(level.prefill(seq[:-1], 32))
            for _ in range(40):
                seq.append(int(level.logits(seq, 1, len(seq) - 1)[0].argmax()))
                if cls is OffloadedKVCache:
                    layouts.add(full.layout())
            level.logits(seq[:-5] + [1, 2, 3, 4, 5, 6, 7], 7, len(seq) - 5)
        caches.append(full)
    resident, streamed = caches
    assert streamed.seq_len == resident.seq_len
    for want, got in zip(resident.read(0, resident.seq_len), streamed.read(0, resident.seq_len)):
        assert torch.equal(want.cpu(), got.cpu())
    assert len(layouts) >= 3 and all(lo % 16 == 0 and hi == min(200, lo + 32) for lo, hi in layouts)
    assert (176, 200) in layouts  # the window cut at the capacity


def test_an_offloaded_cache_replays_its_steps_only_while_a_pass_over_it_is_short(monkeypatch):
    """Graphs save the host's launch time, which long passes hide: past GRAPH_BYTES a pass steps eagerly."""
    cache = OffloadedKVCache(2, 2, 8, 100, torch.float32, "cpu")  # 2 layers x 2 x 2 heads x 8 x 4 B: 256 B a token
    cache.used = 50
    monkeypatch.setattr(offload, "GRAPH_BYTES", 50 * 256)
    assert cache.replays() and KVCache(2, 2, 8, 100, torch.float32, "cpu").replays()
    cache.used = 51
    assert not cache.replays()


def tiny_offload_engine() -> Engine:
    """A two-layer target with a one-layer draft."""
    _, target = tiny_pair(tiny_config(vocab=96, layers=2), seed=0)
    _, draft = tiny_pair(tiny_config(vocab=96, layers=1), seed=1)
    target, draft = target.to(DEVICE), draft.to(DEVICE)
    target.eos_ids = set()
    return Engine.from_models(target, DigitTokenizer(), "tiny", draft, "tiny-draft", 256)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return tiny_offload_engine()


def finish(engine: Engine, **settings) -> Finished:
    cfg = GenerationConfig(**{"method": "triforce", **settings}).validate()
    with torch.no_grad():
        return [e for e in engine.generate_ids(PROMPT, cfg) if isinstance(e, Finished)][0]


@pytest.mark.parametrize("reselect", ["once", "every_verify", 2])
def test_greedy_offloaded_triforce_equals_on_chip_and_ar(engine, reselect):
    base = dict(greedy=True, max_new_tokens=40, budget=32, chunk_size=4, gamma2=6, reselect=reselect)
    ar = finish(engine, method="ar", **base)
    on_chip = finish(engine, offload="off", **base)
    offloaded = finish(engine, offload="on", **base)
    ar_offloaded = finish(engine, method="ar", offload="on", **base)
    assert offloaded.stats.offloaded and not on_chip.stats.offloaded
    assert offloaded.token_ids == on_chip.token_ids == ar.token_ids == ar_offloaded.token_ids
    # the same selections: level 2 accepted exactly what it accepted on chip
    assert (offloaded.stats.level2_accepted, offloaded.stats.level2_proposed) == \
        (on_chip.stats.level2_accepted, on_chip.stats.level2_proposed)
    # decoding streams the cache: about its bytes per level-3 forward, none on chip
    kv_token = 2 * engine.target.args.n_layers * engine.target.args.n_kv_heads * engine.target.args.head_dim * 4
    assert offloaded.stats.host_link_bytes >= offloaded.stats.target_forwards * len(PROMPT) * kv_token
    assert on_chip.stats.host_link_bytes == 0


def test_drafting_ahead_keeps_greedy_tokens_and_shows_each_round_the_draft_it_verified(engine):
    """Level 2 drafts each next round while level 3 verifies (draft_ahead on: on a CPU the two run in turn): the
    tokens are AR's, some rounds verify a draft made ahead, and each round's level-2 verdicts are those of the draft
    its level 3 verified (a draft made ahead and dropped shows nowhere), as many as its timing's level-2 forwards."""
    base = dict(greedy=True, max_new_tokens=40, budget=80, chunk_size=4, gamma2=4, offload="on")
    cfg = GenerationConfig(method="triforce", draft_ahead="on", **base).validate()
    with torch.no_grad():
        events = list(engine.generate_ids(PROMPT, cfg))
    done = events[-1]
    assert done.token_ids == finish(engine, method="ar", **base).token_ids
    assert 0 < done.stats.ahead_kept < done.stats.ahead_made
    streams_to_a_gpu = engine.target.device.type == "cuda"  # draft_ahead auto: only where a GPU streams the cache
    assert (finish(engine, **base).stats.ahead_made > 0) == streams_to_a_gpu
    verdicts = [e for e in events if isinstance(e, Verdict)]
    for v3 in (v for v in verdicts if v.level == 3 and v.proposed):
        drafted = [t for v in verdicts if v.level == 2 and v.round == v3.round
                   for t in v.proposed[:v.accepted] + [v.token]]
        assert drafted[:len(v3.proposed)] == v3.proposed and len(drafted) - len(v3.proposed) < cfg.gamma1 + 1
    timings = [e for e in events if isinstance(e, StepTiming)]
    assert [t.level2_forwards for t in timings] == [sum(v.level == 2 and v.round == t.round for v in verdicts)
                                                    for t in timings]
    assert sum(t.level2_forwards for t in timings) > len(timings)
    level1 = [v for v in verdicts if v.level == 2]
    assert done.stats.level1_proposed == sum(len(v.proposed) for v in level1)
    assert done.stats.level1_accepted == sum(v.accepted for v in level1)


def test_offloaded_auto_equals_ar_without_spending_a_pass_on_an_autoregressive_step():
    """With the full cache streamed, method auto (on an engine that has measured nothing yet) takes its first
    verification's cost for an AR step's."""
    engine = tiny_offload_engine()
    base = dict(greedy=True, max_new_tokens=40, budget=32, chunk_size=4, offload="on")
    cfg = GenerationConfig(method="auto", **base).validate()
    with torch.no_grad():
        events = list(engine.generate_ids(PROMPT, cfg))
    plans = [e for e in events if isinstance(e, PlanChosen)]
    assert plans[0].reason == "measuring what each level costs"
    assert not any("measuring an autoregressive step" in e.reason for e in plans)
    assert [e for e in events if isinstance(e, Finished)][0].token_ids == finish(engine, method="ar", **base).token_ids


def test_offloaded_runs_default_to_the_papers_budget_and_gamma2(engine):
    stats = finish(engine, offload="on", max_new_tokens=4).stats
    assert (stats.settings["budget"], stats.settings["gamma2"]) == (8192, 12)
    stats = finish(engine, offload="off", max_new_tokens=4).stats
    assert (stats.settings["budget"], stats.settings["gamma2"]) == (4096, 6)
    assert finish(engine, offload="on", budget=64, gamma2=3, max_new_tokens=4).stats.settings["gamma2"] == 3


def test_offloaded_hierarchy_is_lossless():
    engine, prompt = tiny_engine()
    draws = 4000
    torch.set_num_threads(1)
    with torch.no_grad():
        expected = target_pairs(engine, prompt)
        counts, levels = emitted_pairs(engine, prompt, draws, offload="on")
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"]
    assert chi_square_p(counts, expected, draws) > 1e-3


def test_placement_offloads_only_beyond_the_device_limit(monkeypatch):
    _, model = tiny_pair(tiny_config(layers=16))  # 4 KiB of keys/values per token in float32
    cfg, prompt = GenerationConfig(method="triforce"), 490_000

    def plan(limit: int, config: GenerationConfig = cfg):
        return Memory(model, None, limit).plan(prompt, config.resolved, config.offload)

    roomy = plan(8 * GiB)
    full = roomy.sizes.full * 4096
    assert roomy.sizes.full == prompt + cfg.max_new_tokens + roomy.cfg.lookahead
    assert not roomy.placement.offloaded and roomy.placement.device["full KV cache"] == full
    assert not roomy.placement.host and (roomy.cfg.budget, roomy.cfg.gamma2) == (4096, 6)
    tight = plan(2 * GiB)
    assert plan(2 * GiB, GenerationConfig(method="ar")).placement == tight.placement  # like for like
    full = tight.sizes.full * 4096  # offloaded runs look further ahead (γ2 12)
    assert tight.placement.offloaded and tight.placement.index_on_device
    assert tight.placement.host == {"full KV cache": full}
    assert tight.placement.device["full KV cache staging (2 layers)"] == full // 8
    assert sum(tight.placement.device.values()) <= 2 * GiB and (tight.cfg.budget, tight.cfg.gamma2) == (8192, 12)
    index = tight.placement.device["chunk index"]
    tighter = plan(sum(tight.placement.device.values()) - index // 2)
    assert tighter.placement.offloaded and not tighter.placement.index_on_device
    assert tighter.placement.host["chunk index"] == index
    with pytest.raises(TriForceError, match="allow offloading"):
        plan(2 * GiB, GenerationConfig(offload="off"))
    with pytest.raises(TriForceError, match="even with the KV cache offloaded"):
        plan(GiB + GiB // 10)
    monkeypatch.setattr("core.cache.memory.host_available", lambda: full // 2)
    with pytest.raises(TriForceError, match="CPU memory"):
        plan(2 * GiB)


def test_the_kept_offloaded_cache_counts_as_available_host_memory(monkeypatch):
    """A next run reuses the previous run's offloaded cache or gives it back before allocating, so the host memory it
    holds (which lowers the machine's MemAvailable, mocked here) is not counted against the run."""
    engine = tiny_offload_engine()
    engine.memory.limit = 2 * GiB  # plans as on a GPU: the host memory is checked
    finish(engine, offload="on", max_new_tokens=4)
    need = engine.memory.kept.cache.nbytes

    def held() -> int:
        return engine.memory.kept.cache.nbytes if engine.memory.kept else 0

    monkeypatch.setattr("core.cache.memory.host_available", lambda: int(1.5 * need) - held())
    assert finish(engine, offload="on", max_new_tokens=4).stats.offloaded  # reused
    assert finish(engine, offload="on", max_new_tokens=40).stats.offloaded  # larger: the old one given back first
    monkeypatch.setattr("core.cache.memory.host_available", lambda: int(0.5 * need) - held())
    with pytest.raises(TriForceError, match="CPU memory"):
        finish(engine, offload="on", max_new_tokens=4)


def test_prompt_ready_says_where_each_cache_lives(engine):
    cfg = GenerationConfig(offload="on", max_new_tokens=2, budget=32, chunk_size=4).validate()
    with torch.no_grad():
        ready = next(e for e in engine.generate_ids(PROMPT, cfg) if isinstance(e, PromptReady))
    assert ready.offloaded and ready.caches["full KV cache"]["where"] == "CPU"
    # the device's caches are a GPU's where there is one; offloading on a CPU exercises the streaming code only
    assert ready.caches["retrieval cache"]["where"] == ("GPU" if engine.target.device.type == "cuda" else "CPU")
