"""Batched decoding: each request's answer is what it is alone (greedy and same-seed sampled token for token, sampled
in distribution), requests join and leave between rounds, a stop ends one request only, the seats bound the batch,
and the batch planner never plans below autoregressive decoding, keeps each request's bounds and learns into the
cost book."""

import dataclasses
import random
import threading
from collections import Counter

import pytest
import torch

import core.batching
import core.decode.request
from core.batching import Request
from core.config import GenerationConfig, TriForceError
from core.decode.sampling import residual_distribution, speculative_verify
from core.engine import Engine
from core.events import Finished, PrefillBeside, PrefillProgress, Tokens
from core.decode.round import Ask, BatchRecord
from core.plan.estimate import CostBook
from core.plan.policy import MAX_SWITCHES, BatchAuto
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

    monkeypatch.setattr(core.decode.request, "speculative_verify", neighbour_residual(speculative_verify))
    with torch.no_grad():
        biased, _, _ = counts(BIASED_DRAWS)
    p_biased = chi_square_p(biased, expected, BIASED_DRAWS)
    assert p_biased < 1e-6, f"a neighbour's residual went unnoticed (p={p_biased:.2e})"


@pytest.mark.parametrize("round_s", [0.0, 1e-4, 1e9])
def test_a_newcomers_prefill_beside_decoding_takes_only_what_the_rounds_allow(engine, prompts, monkeypatch, round_s):
    """While a request decodes, a newcomer's prefill runs only on the time the batch's rounds allow it (PREFILL_SHARE
    of each round's time; a piece of work longer than that is owed and sat out): rounds taking no time allow none, so
    it fills only once the other is done; rounds far too short for a piece let one through now and then, the rounds
    between sat out; rounds with time to spare let the whole prompt through at once. Either way its answer is its
    single run's (its pieces of work are the single run's)."""
    monkeypatch.setattr(core.batching.BatchRun, "round_s", property(lambda self: round_s, lambda self, v: None),
                        raising=False)
    cfg = GenerationConfig(**{**BASE, "method": "ar", "greedy": True, "prefill_chunk": 64}).validate()
    run = core.batching.BatchRun(engine, 2)
    run.submit(Request("first", ids=prompts[3], config=cfg))
    run.submit(Request("newcomer", ids=prompts[2], config=cfg))
    beside, sat_out, answers = [], 0, {}
    with torch.no_grad():
        while run.busy:
            events = run.step()
            decoding = any(t.key == "first" and isinstance(t.event, Tokens) for t in events)
            filled = [t for t in events if t.key == "newcomer" and isinstance(t.event, PrefillProgress)]
            if decoding and filled:
                beside.append(len(filled))
            sat_out += decoding and not filled and "newcomer" not in answers and run.filling is not None
            answers |= {t.key: t.event.token_ids for t in events if isinstance(t.event, Finished)}
    if round_s == 0.0:
        assert not beside
    elif round_s < 1.0:
        assert beside and max(beside) == 1 and sat_out >= len(beside)
    else:
        assert beside and len(beside) == 1
    assert answers["newcomer"] == alone(engine, prompts[2], method="ar", greedy=True, prefill_chunk=64).token_ids


def test_a_request_decoding_beside_a_newcomers_prefill_is_told_while_it_lasts_and_its_stats_count_it(
        engine, prompts, monkeypatch):
    """A decoding request's events say when a newcomer's prefill begins beside it (with the prompt's length) and
    when it ends; its Finished stats count that prefill and the seconds it took of its decoding, so they never say
    it ran alone. The newcomer, which nothing prefilled beside, hears nothing of the kind; its prefill's progress says
    how many requests decode meanwhile (the first's, with nothing decoding, none)."""
    monkeypatch.setattr(core.batching.BatchRun, "round_s", property(lambda self: 1e-3, lambda self, v: None),
                        raising=False)  # rounds allowing a piece of prefill every few rounds
    cfg = GenerationConfig(**{**BASE, "method": "ar", "greedy": True, "prefill_chunk": 64}).validate()
    run = core.batching.BatchRun(engine, 2)
    run.submit(Request("first", ids=prompts[0], config=dataclasses.replace(cfg, max_new_tokens=200)))  # outlasts it
    run.submit(Request("newcomer", ids=prompts[3], config=cfg))
    told: dict[str, list[int]] = {"first": [], "newcomer": []}
    decoding_beside: dict[str, set[int]] = {"first": set(), "newcomer": set()}
    stats = {}
    with torch.no_grad():
        while run.busy:
            for t in run.step():
                if isinstance(t.event, PrefillProgress):
                    decoding_beside[t.key].add(t.event.decoding_beside)
                elif isinstance(t.event, PrefillBeside):
                    told[t.key].append(t.event.prompt_tokens)
                    assert t.event.device == "cpu"
                elif isinstance(t.event, Finished):
                    stats[t.key] = t.event.stats
    assert told == {"first": [len(prompts[3]), 0], "newcomer": []}
    assert decoding_beside == {"first": {0}, "newcomer": {1}}
    assert stats["first"].prefills_beside == 1 and stats["first"].prefill_beside_s > 0
    assert stats["first"].shared_with == 1  # and it decoded beside the newcomer once it joined
    assert stats["newcomer"].prefills_beside == 0 and stats["newcomer"].prefill_beside_s == 0


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


def measured_batch(rng: random.Random) -> tuple[BatchAuto, list[Ask]]:
    """A batch planner that measured a random batch's steps (level 3 as weights + every request's cache + a cost per
    row, level 2 as weights + each drafting request's retrieval cache), with random requests: planned or fixed,
    acceptances, γ2 bounds, and some whose level 2 would read their whole prompt."""
    auto = BatchAuto(CostBook())
    weights, cache, retrieval = rng.uniform(1, 10), rng.uniform(0.1, 20), rng.uniform(0.01, 5)
    n = rng.randint(1, 8)
    asks = []
    for _ in range(n):
        planned = rng.random() < 0.75
        verified = rng.randint(0, 200)
        asks.append(Ask(planned, rng.choice([2, 6, 31]) if planned else rng.choice([0, 4, 6]), rng.random() < 0.9,
                        verified, int(verified * rng.uniform(0.3, 1.0)), 16_000, 4096, True))
    auto.choose(asks)  # its regime's estimates, empty
    for rows in (n, 2 * n, 5 * n):
        for _ in range(3):
            auto.observe(BatchRecord(rows, weights + cache * n + 0.05 * rows))
    for drafting in (1, n):
        for _ in range(3):
            auto.observe(BatchRecord(n, weights + cache * n + 0.05 * n, drafting, 1, weights + retrieval * drafting))
    return auto, asks


def test_batch_plan_is_never_below_autoregressive_and_keeps_each_requests_bounds():
    """On 300 random batches the γ2s chosen are priced at least as fast as autoregressive decoding; no planned
    request drafts past its own γ2 bound, nor at all where its level 2 would read its whole prompt; a request whose
    settings fix its γ2 keeps it."""
    rng = random.Random(0)
    for _ in range(300):
        auto, asks = measured_batch(rng)
        for _ in range(3):  # weighing, then kept
            gammas = auto.choose(asks)
            auto.rounds = 10  # as if MIN_ROUNDS had passed
        rates = auto.rates(asks, [0, auto.gamma])
        assert rates[auto.gamma] >= rates[0] * (1 - 1e-9)
        for a, g in zip(asks, gammas):
            if a.planned:
                assert g <= a.gamma2 and (g == 0 or a.level2)
            else:
                assert g == a.gamma2


def batch_of(level3_fixed: float, level2: float, alpha_seen: tuple[int, int] = (1000, 990), n: int = 8
             ) -> tuple[BatchAuto, list[Ask]]:
    """A batch of `n` planned requests whose level 3 costs `level3_fixed` + 0.1 ms a row and level 2 `level2` a step,
    each having seen `alpha_seen` (verified, accepted)."""
    auto = BatchAuto(CostBook())
    asks = [Ask(True, 31, True, *alpha_seen, 16_000, 4096, True)] * n
    auto.choose(asks)
    for rows in (n, 5 * n):
        auto.observe(BatchRecord(rows, level3_fixed + 0.1 * rows, n, 1, level2))
        auto.observe(BatchRecord(rows, level3_fixed + 0.1 * rows, 1, 1, level2))
    return auto, asks


def test_batch_drafts_where_caches_dominate_and_not_where_level_2_costs_a_full_step():
    """Where level 2 costs a tenth of level 3 and is nearly always accepted, the batch drafts; where a level-2 step
    costs as much as a full one, it does not, and says in words why."""
    cheap, asks = batch_of(100.0, 10.0)
    assert cheap.choose(asks)[0] > 0 and "autoregressive" in cheap.reason
    dear, asks = batch_of(10.0, 10.0)
    assert dear.choose(asks)[0] == 0 and "would not pay" in dear.reason


def test_a_batch_whose_level_2_would_read_the_whole_prompt_says_so_and_does_not_draft():
    """A planned request whose retrieval budget covers its whole prompt never drafts, and the reason says why."""
    auto = BatchAuto(CostBook())
    assert auto.choose([Ask(True, 31, False, 0, 0, 600, 4096, True)]) == [0]
    assert "covers the whole prompt" in auto.reason


def test_batch_weighs_acceptance_with_caution():
    """The same acceptance seen over few drafts counts for less than over many: a batch that drafts long at 0.9
    seen over 2,000 verifications drafts shorter (or not at all) at 0.9 seen over 10."""
    sure, asks = batch_of(20.0, 4.0, (2000, 1800))
    unsure, few = batch_of(20.0, 4.0, (10, 9))
    assert unsure.choose(few)[0] < sure.choose(asks)[0]


def test_a_second_batch_starts_from_what_the_first_measured():
    """The batch's step costs go into the engine's cost book under the batched regime: a second batch of the same
    kind weighs at once instead of measuring, and a batch's switches stay within MAX_SWITCHES."""
    first, asks = batch_of(100.0, 10.0)
    assert first.choose(asks)[0] > 0
    first.finish()
    second = BatchAuto(first.book)
    assert second.choose(asks)[0] > 0 and not second.measuring
    flip = BatchAuto(CostBook())
    flip.choose(asks)
    for i in range(60):  # costs that swing every round: the planner may follow them only so often
        cost = 100.0 if i % 2 else 10.0
        for _ in range(9):
            flip.observe(BatchRecord(8, cost + 0.8, 8, 1, 10.0))
            flip.observe(BatchRecord(40, cost + 4.0, 8, 1, 10.0))
        flip.rounds = 10
        flip.choose(asks)
    assert flip.switches <= MAX_SWITCHES
