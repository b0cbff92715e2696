"""Batched decoding: each request's answer is what it is alone (greedy and same-seed sampled token for token, sampled
in distribution), requests join and leave between rounds, a stop ends one request only, the seats bound the batch,
and the batch planner never plans below autoregressive decoding."""

import random
import threading
from collections import Counter

import pytest
import torch

import core.decode.batch
from core.batching import Request
from core.config import GenerationConfig, TriForceError
from core.decode.sampling import residual_distribution, speculative_verify
from core.engine import Engine
from core.events import Finished, Tokens
from core.plan.batch import BatchPlanner
from core.serving import BatchServer
from tests.lossless import BIASED_DRAWS, CFG, DRAWS, target_pairs, tiny_engine
from tests.stats import chi_square_p
from tests.tiny import DigitTokenizer, tiny_config, tiny_pair

LENGTHS = (300, 200, 450, 120)
BASE = dict(max_new_tokens=40, budget=64, chunk_size=8, drafter="none")


@pytest.fixture(scope="module")
def engine() -> Engine:
    """A tiny target with a tiny level-1 draft model."""
    _, target = tiny_pair(tiny_config(vocab=96, layers=2, max_position=1024), seed=0, scale=2.0)
    _, draft = tiny_pair(tiny_config(vocab=96, layers=1, max_position=1024), seed=1, scale=2.0)
    target.requires_grad_(False).eos_ids = set()
    return Engine.from_models(target, DigitTokenizer(), "tiny", draft.requires_grad_(False), "tiny draft", 1024)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in LENGTHS]


def alone(engine: Engine, ids: list[int], **settings) -> Finished:
    cfg = GenerationConfig(**{**BASE, **settings}).validate()
    return next(e for e in engine.generate_ids(ids, cfg) if isinstance(e, Finished))


def together(engine: Engine, prompts: list[list[int]], settings: list[dict], slots: int) -> list[Finished]:
    requests = [Request(str(i), ids=p, config=GenerationConfig(**{**BASE, **s}).validate())
                for i, (p, s) in enumerate(zip(prompts, settings))]
    done = {t.key: t.event for t in engine.generate_many(requests, slots) if isinstance(t.event, Finished)}
    return [done[str(i)] for i in range(len(requests))]


MIXES = {
    "autoregressive": [dict(method="ar", greedy=True)] * 4,
    "triforce": [dict(method="triforce", greedy=True)] * 4,
    "auto": [dict(method="auto", greedy=True)] * 4,
    "mixed methods and draft lengths": [dict(method="ar", greedy=True), dict(method="triforce", greedy=True),
                                        dict(method="auto", greedy=True), dict(method="triforce", greedy=True,
                                                                               gamma2=3)],
    "sampled triforce": [dict(method="triforce", temperature=0.8, seed=s) for s in range(4)],
    "sampled autoregressive": [dict(method="ar", temperature=0.8, top_p=0.9, seed=s) for s in range(4)],
    "sampled triforce with a repetition penalty": [dict(method="triforce", temperature=0.8, seed=s,
                                                        repetition_penalty=1.3) for s in range(4)],
    "three levels": [dict(method="triforce", greedy=True, drafter="model", window_tokens=32)] * 4,
    "three levels sampled": [dict(method="triforce", temperature=0.8, seed=s, drafter="model", window_tokens=32)
                             for s in range(4)],
    "prompt lookup at level 1 beside the others": [
        dict(method="triforce", greedy=True, drafter="ngram"), dict(method="auto", greedy=True),
        dict(method="triforce", temperature=1.0, seed=2, drafter="model", window_tokens=32), dict(method="ar")],
}


@pytest.mark.parametrize("slots", [4, 2])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_each_request_emits_its_single_request_tokens(engine, prompts, mix, slots):
    """Greedy, and sampled with the same seed, each request's tokens are those it emits alone (a batch drafts and
    draws as a single run does, level 1 included), whatever its neighbours' methods; with 2 seats the later requests
    wait, then join a batch already decoding."""
    settings = MIXES[mix]
    with torch.no_grad():
        batched = together(engine, prompts, settings, slots)
        single = [alone(engine, p, **s) for p, s in zip(prompts, settings)]
    assert [b.token_ids for b in batched] == [s.token_ids for s in single]
    assert all(b.stats.shared_with == slots - 1 for b in batched[:2])  # decoded beside the others
    if mix == "triforce":  # level 2 drafted and level 3 rejected some of it: verification really ran per request
        assert all(0 < b.stats.level2_accepted < b.stats.level2_verified for b in batched)
    if mix.startswith("three levels"):  # level 1 proposed and level 2 rejected some of it, as alone
        assert all(0 < b.stats.level1_accepted < b.stats.level1_verified for b in batched)
        assert [b.stats.level1_accepted for b in batched] == [s.stats.level1_accepted for s in single]


def neighbour_residual(real):
    """speculative_verify whose residual after a rejection comes from the previous request's distribution (the same
    row), not this request's own: a batch that mixed up its requests' rows."""
    last = {}

    def verify(draft, q, p, generator, residual=residual_distribution):
        neighbour, last["p"] = last.get("p"), p
        if neighbour is None or neighbour.shape != p.shape:
            return real(draft, q, p, generator, residual)

        def mixed(pi, qi):
            row = (pi.data_ptr() - p.data_ptr()) // (p.stride(0) * p.element_size())
            return residual(neighbour[row], qi)
        return real(draft, q, p, generator, mixed)
    return verify


def test_batched_sampling_is_lossless_and_detects_a_neighbours_residual(monkeypatch, one_thread):
    """Requests on two prompts decoded in batches of four: the two tokens each request on the first prompt emits
    follow the target's exact distribution; the same test fails when a rejected draft's residual comes from the
    neighbouring request's distribution."""
    engine, first = tiny_engine()
    engine.draft = None
    second = first[::-1]
    settings = {k: v for k, v in CFG.items() if k not in ("drafter", "gamma1")}

    def counts(draws: int) -> tuple[Counter, int, int]:
        seen, proposed, accepted = Counter(), 0, 0
        for batch in range(draws // 2):
            requests = [Request(str(i), ids=first if i % 2 == 0 else second,
                                config=GenerationConfig(**settings, drafter="none", seed=4 * batch + i).validate())
                        for i in range(4)]
            for t in engine.generate_many(requests, 4):
                if isinstance(t.event, Finished) and int(t.key) % 2 == 0:
                    seen[tuple(t.event.token_ids)] += 1
                    proposed += t.event.stats.level2_verified
                    accepted += t.event.stats.level2_accepted
        return seen, proposed, accepted

    with torch.no_grad():
        expected = target_pairs(engine, first)
        seen, verified, accepted = counts(DRAWS)
    assert 0 < accepted < verified  # level 3 rejects some of level 2's drafts: residuals are drawn
    p_ok = chi_square_p(seen, expected, DRAWS)
    assert p_ok > 1e-3, f"batched sampler rejected (p={p_ok:.2e})"

    monkeypatch.setattr(core.decode.batch, "speculative_verify", neighbour_residual(speculative_verify))
    with torch.no_grad():
        biased, _, _ = counts(BIASED_DRAWS)
    p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
    assert p_biased < 1e-6, f"a neighbour's residual went unnoticed (p={p_biased:.2e})"


def test_a_stopped_request_leaves_and_the_others_finish(engine, prompts):
    """Closing one request's stream ends it at the next round (no Finished); the others emit their own answers;
    a request beyond the seats waits in line with its place told, then runs."""
    server = BatchServer(engine, slots=2)
    greedy = dict(method="triforce", greedy=True)
    results, places = {}, {}

    def visitor(i: int, stop_after: int | None) -> None:
        got = 0
        cfg = GenerationConfig(**{**BASE, **greedy, "max_new_tokens": 60}).validate()
        for event in server.submit(Request(str(i), ids=prompts[i], config=cfg)):
            got += len(event.ids) if isinstance(event, Tokens) else 0
            if stop_after is not None and got >= stop_after:
                break
            if isinstance(event, Finished):
                results[i] = event

    with torch.no_grad():
        threads = [threading.Thread(target=visitor, args=(i, 8 if i == 1 else None)) for i in range(4)]
        for t in threads:
            t.start()
        places.update({i: server.position(str(i)) for i in range(4)})
        for t in threads:
            t.join(timeout=120)
        assert sorted(results) == [0, 2, 3]
        for i in results:
            assert results[i].token_ids == alone(engine, prompts[i], **{**greedy, "max_new_tokens": 60}).token_ids
            assert results[i].stats.shared_with <= 1  # two seats
    assert any(place is not None for place in places.values())  # someone waited in line
    assert server.thread is None or not server.thread.is_alive() or not server.run.busy


def test_bad_requests_are_refused_before_anything_runs(engine, prompts):
    """A bad request in a batch is refused in one line and nothing is decoded; the server keeps serving."""
    good = Request("a", ids=prompts[0], config=GenerationConfig(**BASE).validate())
    with pytest.raises(TriForceError, match="token ids"):
        list(engine.generate_many([good, Request("b", ids=[10**6])]))
    with pytest.raises(TriForceError, match="already"):
        list(engine.generate_many([good, Request("a", ids=prompts[1])]))
    with pytest.raises(TriForceError, match="1 to"):
        list(engine.generate_many([good], slots=0))
    server = BatchServer(engine, slots=2)
    with pytest.raises(TriForceError):
        server.submit(Request("x", ids=[]))
    with torch.no_grad():
        events = list(server.submit(Request("y", ids=prompts[3], config=GenerationConfig(**BASE).validate())))
    assert isinstance(events[-1], Finished)


def plan_case(rng: random.Random) -> tuple[BatchPlanner, list[tuple[int, int]], list[int]]:
    """A planner that measured a random batch's steps: level 3 as weights + every request's cache per row, level 2 as
    weights + retrieval caches per request drafting; random acceptances and fixed neighbours."""
    planner = BatchPlanner(31)
    weights, cache, retrieval = rng.uniform(1, 10), rng.uniform(0.1, 20), rng.uniform(0.01, 5)
    slots = rng.randint(1, 8)
    for rows in (slots, 2 * slots, 5 * slots):
        planner.level3.add(rows, weights + cache * slots + 0.05 * rows)
    for drafting in (1, slots):
        planner.level2.add(drafting, weights + retrieval * drafting)
    auto = [(v, int(v * rng.uniform(0.3, 1.0))) for v in (rng.randint(0, 200) for _ in range(slots))]
    fixed = [rng.choice([0, 4, 6]) for _ in range(rng.randint(0, 3))]
    return planner, auto, fixed


def test_batch_plan_is_never_below_autoregressive_and_drafts_where_caches_dominate():
    """On 300 random batches the chosen γ2 is planned at least as fast as autoregressive decoding; where level 2
    costs a tenth of level 3 and level 2 is nearly always accepted, the batch drafts; where a level-2 step costs as
    much as level 3's, it does not."""
    rng = random.Random(0)
    for _ in range(300):
        planner, auto, fixed = plan_case(rng)
        for _ in range(3):  # measuring, then weighing
            gamma = planner.choose(auto, fixed)
        alphas = [(a + 0.9 * 4) / (v + 4) for v, a in auto]
        assert planner.rate(alphas, fixed, gamma) >= planner.rate(alphas, fixed, 0) * (1 - 1e-9)
    cheap, dear = BatchPlanner(31), BatchPlanner(31)
    for rows in (8, 40):
        cheap.level3.add(rows, 100.0 + rows * 0.1)
        dear.level3.add(rows, 10.0 + rows * 0.1)
    for drafting in (1, 8):
        cheap.level2.add(drafting, 10.0)
        dear.level2.add(drafting, 10.0)
    seen = [(1000, 990)] * 8
    assert cheap.choose(seen, []) and cheap.choose(seen, []) > 0
    assert dear.choose(seen, []) == 0 and dear.choose(seen, []) == 0
