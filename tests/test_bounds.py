"""Work and memory bounded by what a run needs: caches sized by the budget capped at the prompt, only the caches the
last run used kept when it ends (memory after many runs of varied sizes stays at one run's), level 2 drafting no more
than the answer still wants."""

import threading
import time

import pytest
import torch

import core.decode.request
import core.decode.triforce
from core.config import GenerationConfig
from core.engine import Engine
from core.events import Finished, PlanChosen, PrefillProgress, Tokens
from core.cache.kvcache import KVCache
from core.decode.levels import LayerByLayer
from core.config import DECODE_TOKENS
from tests.tiny import DigitTokenizer, tiny_config, tiny_pair

VOCAB = 32
CFG = dict(method="triforce", max_new_tokens=4, chunk_size=4, gamma1=2, gamma2=3, drafter="model", greedy=True,
           sink_tokens=4, window_tokens=12)


def tiny_engine() -> Engine:
    _, target = tiny_pair(tiny_config(vocab=VOCAB, layers=1, max_position=1024), seed=0)
    _, draft = tiny_pair(tiny_config(vocab=VOCAB, layers=1, max_position=1024), seed=1)
    target.eos_ids = set()
    return Engine(target.requires_grad_(False), DigitTokenizer(), "tiny", draft.requires_grad_(False), "tiny-draft",
                  1024)


def prompt(length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def run(engine: Engine, length: int, **settings) -> Finished:
    cfg = GenerationConfig(**{**CFG, **settings}).validate()
    return [e for e in engine.generate_ids(prompt(length), cfg) if isinstance(e, Finished)][0]


def bytes_per_token(engine: Engine) -> int:
    a = engine.target.args
    return 2 * a.n_layers * a.n_kv_heads * a.head_dim * engine.target.dtype.itemsize


def held(engine: Engine) -> int:
    """Bytes of the caches the engine keeps between runs: its pool and the last prompt's full cache."""
    return sum(c.nbytes for c in engine.memory.caches())


def test_retrieval_cache_is_sized_by_the_prompt_not_the_budget():
    engine = tiny_engine()
    finished = run(engine, 48, budget=1 << 20)
    extra = CFG["max_new_tokens"] + GenerationConfig(**CFG).resolved(False).lookahead
    assert finished.stats.retrieval_cache_bytes <= (48 + CFG["chunk_size"] + extra) * bytes_per_token(engine)


# (prompt length, budget, window): budgets above and below the prompt, draft windows of different sizes
RUNS = [(600, 512, 12), (48, 4096, 12), (300, 64, 40), (900, 800, 200), (40, 8, 12), (200, 128, 64)]


def test_memory_after_varied_runs_returns_to_one_runs():
    alone = []
    for length, budget, window in RUNS:  # each run on a fresh engine: what it needs by itself
        engine = tiny_engine()
        run(engine, length, budget=budget, window_tokens=window)
        alone.append(held(engine))
    engine = tiny_engine()
    for (length, budget, window), need in zip(RUNS * 2, alone * 2):
        run(engine, length, budget=budget, window_tokens=window)
        assert held(engine) <= 2 * need, (length, budget, window, held(engine), need)
    assert held(engine) <= max(alone)


def test_same_sized_caches_are_reused_and_a_closed_run_is_trimmed():
    engine = tiny_engine()
    run(engine, 120, budget=64)
    kept = list(engine.memory.pool.caches)  # held here, so no new cache can take an old one's id
    run(engine, 124, budget=64)
    assert engine.memory.pool.caches == kept and len(kept) == 2  # retrieval + draft cache
    events = engine.generate_ids(prompt(700), GenerationConfig(**CFG, budget=600).validate())
    next(e for e in events if isinstance(e, Tokens))
    events.close()  # stopped mid-run: the caches it used are kept (the draft's again), the smaller retrieval one not
    assert not engine.memory.pool.taken and len(engine.memory.pool.caches) == 2
    assert len({id(c) for c in kept} & {id(c) for c in engine.memory.pool.caches}) == 1


def test_a_cache_that_no_longer_fits_is_given_back_before_its_successor_is_allocated():
    engine = tiny_engine()
    run(engine, 120, budget=64)
    pooled = engine.memory.pool.caches
    small = next(c for c in pooled if type(c) is KVCache)  # the retrieval cache; the other: the draft's
    draft = next(c for c in pooled if c is not small)
    events = engine.generate_ids(prompt(700), GenerationConfig(**CFG, budget=600).validate())
    next(e for e in events if isinstance(e, Tokens))  # mid-run: the new retrieval cache is in use
    pooled = engine.memory.pool.caches
    assert len(pooled) == 2 and small not in pooled and draft in pooled
    events.close()


def test_a_set_stop_ends_a_prefill_forward_between_two_layers():
    def engine() -> Engine:
        _, target = tiny_pair(tiny_config(vocab=VOCAB, layers=2, max_position=1024), seed=0)
        target.eos_ids = set()
        return Engine(target.requires_grad_(False), DigitTokenizer(), "tiny", None, None, 1024)

    stopped, stop, later_layers = engine(), threading.Event(), []
    first = stopped.target.layers[0].register_forward_hook(lambda *_: stop.set())  # stop asked during layer 0
    stopped.target.layers[1].register_forward_hook(lambda *_: later_layers.append(1))
    cfg = GenerationConfig(**{**CFG, "method": "ar"}).validate()
    events = list(stopped.generate_ids(prompt(300), cfg, stop))
    assert not later_layers and not any(isinstance(e, (PrefillProgress, Finished)) for e in events)
    first.remove()
    # nothing half-done is kept
    again = [e for e in stopped.generate_ids(prompt(300), cfg) if isinstance(e, Finished)][0]
    fresh = [e for e in engine().generate_ids(prompt(300), cfg) if isinstance(e, Finished)][0]
    assert not again.stats.prefill_reused and again.token_ids == fresh.token_ids


def test_a_prefill_forward_on_its_helper_thread_waits_at_each_layer_until_asked_for_the_next():
    """A batch paces a newcomer's prefill by pausing its iteration (core.batching): the forward must pause with it,
    not go on computing beside the other requests' rounds."""
    computed = []

    def forward(between) -> str:
        for layer in range(3):
            between()
            computed.append(layer)
        return "done"

    steps = LayerByLayer(forward, lambda: None)
    layers = iter(steps)
    assert next(layers) == 0
    time.sleep(0.2)  # the consumer pauses: a forward running on would compute every layer meanwhile
    assert computed == []
    assert next(layers) == 1 and computed == [0]
    assert list(layers) == [2] and computed == [0, 1, 2] and steps.result == "done"


@pytest.mark.parametrize("drafter", ["none", "ngram", "model"])
def test_level2_drafts_no_more_than_the_answer_wants(monkeypatch, drafter):
    levels = []

    class Counted(core.decode.request.Level):  # level 2, remembered to count its forwards
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            levels.append(self)

    monkeypatch.setattr(core.decode.request, "Level", Counted)
    engine = tiny_engine()
    for max_new in (1, 2, 5):
        levels.clear()
        finished = run(engine, 64, budget=32, gamma2=32, max_new_tokens=max_new, drafter=drafter)
        assert finished.stats.new_tokens == max_new
        # each round drafts at most what is still wanted: max_new, then fewer
        assert levels[0].forwards <= max_new * (max_new + 1) // 2
        assert finished.stats.level2_proposed <= max_new * (max_new + 1) // 2


def test_warm_up_runs_each_path_and_keeps_no_prompt_cache(embedded):
    """Engine.warm_up (the app runs it before serving on a GPU) goes through AR, greedy and sampled TriForce and
    method auto on a real prompt, one verification as long as a decode step gets (the largest GEMV block compiles
    then, not in a request), then two batches of two (drafting, then not), then gives back its caches, so a first
    request starts clean -- and from the costs the warm-up measured: a first auto run on a longer document spends no
    round on measuring them, and a first batch starts from the batched regime's."""
    stats = embedded.warm_up(new_tokens=4)
    assert [(s.method, s.settings["greedy"]) for s in stats] == [("ar", True), ("triforce", True), ("triforce", False),
                                                                 ("auto", False), *[("triforce", False)] * 2,
                                                                 *[("ar", False)] * 2]
    assert all(s.new_tokens > 0 and 500 < s.prompt_tokens < 1024 for s in stats)
    assert stats[2].level2_proposed > 0
    assert any(regime.batched for kind, regime, *_ in embedded.costs.steps if kind == "level3")
    assert any(DECODE_TOKENS in samples for (kind, *_), samples in embedded.costs.steps.items()
               if kind == "level3")  # level-3 steps measured, by rows
    assert not embedded.memory.caches()
    document = "\n".join(f"Line {i}: the {i % 7}th verse of the long song." for i in range(150))  # ~2K tokens
    with torch.no_grad():
        events = list(embedded.generate(document, "Sing on.", embedded.settings(method="auto", greedy=True,
                                                                                 max_new_tokens=4)))
    plans = [e for e in events if isinstance(e, PlanChosen)]
    assert events[-1].stats.prompt_tokens > 1024 and plans and not plans[0].reason.startswith("measuring")


def test_level_2s_first_selection_is_filled_before_decoding_starts(embedded):
    """The first selection (from the prefill's last queries) belongs to filling the caches, as in the paper: it
    comes before the first plan and token, and its time is prefill time, not decoding time."""
    with torch.no_grad():
        events = list(embedded.generate("A short note about chunks and caches. " * 40, "Go on.",
                                        embedded.settings(method="auto", max_new_tokens=4)))
    kinds = [type(e).__name__ for e in events]
    first = kinds.index("RetrievalSelection")
    assert first < kinds.index("PlanChosen") and first < kinds.index("Tokens")
    assert events[-1].stats.prefill_s >= events[first].seconds


def test_a_streaming_window_larger_than_the_prompt_is_clamped_and_stays_exact():
    """Sink and window far beyond a short prompt: the level-1 cache holds only what the prompt and answer need, and
    rolling it back after rejections (every token then sits in the sink) works; greedy output equals AR."""
    engine = tiny_engine()
    wide = dict(sink_tokens=4096, window_tokens=65536, max_new_tokens=12, budget=16)
    triforce = run(engine, 171, **wide)
    ar = run(engine, 171, **wide, method="ar")
    assert triforce.token_ids == ar.token_ids and triforce.stats.level1_proposed > 0
    level1 = triforce.stats.level1_cache_bytes
    lookahead = GenerationConfig(**{**CFG, **wide}).resolved(False).lookahead
    assert level1 <= (171 + 12 + lookahead) * bytes_per_token(engine)
