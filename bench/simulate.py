"""Method auto, replayed: `python -m bench.simulate [--seeds 20] [--tokens 128]`.

Each regime recorded in bench/results (the real Qwen2.5-Coder pair on-chip and offloaded at 30K, the random 7B shape
on-chip at 120K, the random 7B / 8B shapes offloaded at 128K, the embedded model on this CPU, the served app's
sampled click at 8K on a GPU) becomes a profile: what each kind of step costs by rows, what each level accepts, what
the hardware allows (drafting ahead, chained level-2 forwards). A run is then simulated round by round: the policy
chooses a hierarchy, the simulator draws which drafts stand (each accepted with its level's probability) and what
each step took (its recorded cost with noise: lognormal jitter and, now and then, a stall), and hands the policy the
round's record, as the engine does. Per regime and seed: a warm-up run of method triforce and an autoregressive run
fill the cost book (as the engine's warm-up and a Compare click do), then method auto runs. Reported per regime, means
over seeds: auto over autoregressive decoding, auto over the best fixed plan in hindsight (the fastest of the
candidates the cost model ranks highest, each simulated with the same seeds), and auto over the planner it replaced
(new_over_old: that planner's rates on the same profiles and seeds, recorded in bench/legacy-planner.json
before its code went).

Batched regimes (each setting whose rounds bench.batch recorded) run the batch's policy (core.plan.policy.BatchAuto)
round by round the same way: each request's drafts stand with the regime's acceptance, each step costs what was
recorded for its rows. Reported: auto over batched AR and over the best fixed γ2, on a first batch and a next one.

Each case bench.planner recorded on real weights (bench/results/planner-real-<device>.json) is replayed from its own
runs' rounds, a case after another answer after its first answer's case: auto over AR predicted beside measured.
Writes bench/results/simulate.json with summary.simulate.{regime}.{auto_over_ar, auto_over_best_fixed[,
new_over_old]} and the replayed cases under `traces`.

What a profile takes from a result file is read from it; what no benchmark recorded is an assumption named in the
profile's `assumed` list (shown in the output)."""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import statistics
from dataclasses import asdict, dataclass, field, replace

from bench.common import RESULTS, environment, save
from core.config import AUTO_GAMMA2
from core.decode import AUTOREGRESSIVE, SHADOW_GAMMA, Draft, Forwards, Hierarchy, RoundRecord
from core.decode.round import Ask, BatchRecord
from core.plan import Auto, CostBook, Drafter, Figures, Fixed, Line, Regime, candidates, rate
from core.plan.policy import BatchAuto

GAMMA1 = 2  # GenerationConfig's default γ1: auto's longest level-1 draft per level-2 check
REAL_ALPHA = 0.91  # level 3's acceptance of level 2 on the real Qwen2.5-Coder-1.5B at 8 × 30K (H100, greedy)
SIGMA = 0.05  # lognormal jitter of a measured step (a few % between two runs of one plan on the H200)
STALL, STALL_FACTOR = 0.02, 3.0  # a step now and then held up (a GC pause, the other thread), by this factor
WARM_TOKENS, AR_TOKENS = 64, 32


@dataclass
class Level1:
    """A level-1 drafter's recorded figures: ms per token asked, acceptance at level 2 and 3, share proposed."""

    ms: float
    a1: float
    a13: float
    offered: float
    in_passing: bool


@dataclass
class Profile:
    """One regime's truth: step costs (ms) and acceptances, and what the hardware allows."""

    name: str
    level3: dict[int, float]  # by rows; between recorded sizes linear, beyond the largest flat (or `linear`)
    level2: float  # a forward checking level 1 (γ1 + 1 rows)
    level2_one: float  # a forward of one row (level 2 drafting alone, not chained)
    chained: float | None  # a forward drafting alone, chained on the device (None: not on this hardware)
    drafters: dict[str, Level1]
    a2: float
    overhead: float = 0.0
    beside: float = 1.0  # level 2's slow-down beside level 3's pass (drafting ahead)
    post: float = 0.0
    streamed: bool = False
    ahead: bool = False
    greedy: bool = False
    prompt_tokens: int = 30000
    linear: bool = False  # level 3 beyond its largest recorded size goes on along its last segment (a CPU)
    assumed: list[str] = field(default_factory=list)

    def step3(self, rows: int) -> float:
        sizes = sorted(self.level3)
        if rows <= sizes[0]:
            return self.level3[sizes[0]]
        if rows >= sizes[-1] and not (self.linear and len(sizes) > 1):
            return self.level3[sizes[-1]]
        i = min(bisect.bisect_left(sizes, rows), len(sizes) - 1)
        a, b = sizes[i - 1], sizes[i]
        return self.level3[a] + (self.level3[b] - self.level3[a]) * (rows - a) / (b - a)

    def figures(self) -> Figures:
        """The truth as the cost model would see it with every figure known exactly (for ranking fixed plans)."""
        sizes = sorted(self.level3)
        multi = [r for r in sizes if r > 1] or sizes
        slope = (self.level3[multi[-1]] - self.level3[multi[0]]) / (multi[-1] - multi[0]) if len(multi) > 1 else 0.0
        fixed = self.level3[multi[0]] - slope * multi[0]
        saving = fixed + slope - self.level3[1] if 1 in self.level3 else None
        level3 = Line(fixed, slope, saving, True)
        level2 = Line(self.level2_one, (self.level2 - self.level2_one) / GAMMA1, None, True)
        chained = Line(self.chained) if self.chained is not None else None
        return Figures(level3, level2, chained, Line(level2.fixed * self.beside, level2.per_row * self.beside),
                       Line(chained.fixed * self.beside) if chained else None, self.overhead, self.post,
                       {n: Drafter(d.ms, d.a1, d.a13, d.offered) for n, d in self.drafters.items()}, self.a2,
                       self.a2)


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def real_profiles() -> list[Profile]:
    """The real Qwen2.5-Coder-1.5B + 0.5B pair at 30K tokens, each document, from bench.real's `bound`: the costs
    the engine's cost book held after the sampled runs and the acceptances the fixed runs saw."""
    out = []
    for file, part in (("real-onchip-NVIDIA-H200", "onchip"), ("real-NVIDIA-H200", "offload")):
        for doc, v in load(file)[part].items():
            b, offloaded = v["bound"], part == "offload"
            assumed = ["level 2 drafting alone, one row, not chained: the chained forward's cost",
                       "level 3 accepts level 2's guess as often as a draft (a2)", "a13 = a1"]
            if offloaded:
                assumed.append("what follows the pass: 1.5 ms (not recorded; the pass's head and verification)")
            beside = b["level2_ahead_ms"] / b["level2_ms"] if b.get("level2_ahead_ms") else 1.0
            drafters = {n: Level1(ms, b["a1"][n], b["a1"][n], b["offered"][n], n == "ngram")
                        for n, ms in b["level1_ms"].items()}
            out.append(Profile(f"real_{part}_30k_{doc.split('@')[0]}", {int(k): ms for k, ms in b["level3_ms"].items()},
                               b["level2_ms"], b["level2_alone_ms"], b["level2_alone_ms"], drafters, b["a2"],
                               b["overhead_ms"], beside, 1.5 if offloaded else 0.0, offloaded, offloaded,
                               assumed=assumed))
    return out


def at_real_acceptance(prof: Profile) -> Profile:
    """A random-weight profile's step costs at what a real model's level 2 is accepted, REAL_ALPHA: random weights
    accept nearly every draft, so their own speed-ups hold only there."""
    return replace(prof, name=f"{prof.name}_at_{REAL_ALPHA}", a2=REAL_ALPHA,
                   assumed=[*prof.assumed, f"level 2 accepted {REAL_ALPHA} (the real pair's; random weights "
                                           f"accepted {prof.a2:.2f}), level 1 as recorded"])


def random_profiles() -> list[Profile]:
    """The random 7B shape on-chip at 120K (bench.planner) and the 7B / 8B shapes offloaded at 128K (bench.offload),
    sampled: level 3 by rows from the cost book's sampled regime (offloaded) or the runs' rounds (on-chip), level 2
    per forward and the acceptances from the fixed TriForce runs' rounds; each also at_real_acceptance. Random
    weights: prompt lookup does not draft there (the fixed runs drafted with the draft model)."""
    out = []
    planner = load("planner-runs-NVIDIA-H200")["runs"]
    tf, ar = planner["triforce sampled"], planner["ar sampled"]
    forwards = sum(r[3] for r in tf["rounds"])
    level2 = sum(r[0] for r in tf["rounds"]) / forwards
    gamma2 = tf["settings"]["gamma2"]
    step7 = statistics.median(r[1] for r in tf["rounds"] if r[3])
    out.append(Profile("random_7b_onchip_120k", {1: ar["level3_ms"], gamma2 + 1: step7}, level2, level2, level2,
                       {"model": Level1(tf["level1_ms"] * tf["tokens_per_target_forward"] / GAMMA1 / 2,
                                        tf["level1_acceptance"], tf["level1_acceptance"], 1.0, False)},
                       tf["level2_acceptance"], prompt_tokens=tf["prompt_tokens"],
                       assumed=["level 3 linear between 1 and 7 rows, flat beyond",
                                "a level-1 token's ms from the run's per-token level-1 time"]))
    for shape, v in load("offload-NVIDIA-H200")["shapes"].items():
        book = v["level3_ms_before_auto"]["(True, 17, False)"]
        runs = {(r["method"], r["sampling"]): r for r in v["runs"]}
        tf = runs[("triforce", "T0.6/top-p0.9")]
        forwards = sum(r[3] for r in tf["rounds"])
        level2 = sum(r[0] for r in tf["rounds"]) / forwards
        out.append(Profile(f"random_{shape}_offload_128k", {int(k): ms for k, ms in book.items()}, level2, level2,
                           level2, {"model": Level1(tf["level1_ms"] * tf["tokens_per_target_forward"] / GAMMA1 / 2,
                                                    tf["level1_acceptance"], tf["level1_acceptance"], 1.0, False)},
                           tf["level2_acceptance"], 0.5, 1.15, 1.5, True, True, prompt_tokens=tf["prompt_tokens"],
                           assumed=["level 2 beside the pass 15 % slower (the real pair's)", "post 1.5 ms",
                                    "overhead 0.5 ms", "a level-1 token's ms from the run's per-token level-1 time"]))
    return [q for prof in out for q in (prof, at_real_acceptance(prof))]


def cpu_profile() -> list[Profile]:
    """The embedded SmolLM2-135M on this 2-core CPU at ~8K tokens: each step's pieces by rows from bench.cpu_steps
    (the forward on the full and on the retrieval cache, the LM head, repetition control, the distributions) and the
    acceptances bench.cpu saw (budget 1024 there, 512 here) with each level-1 drafter."""
    steps = load("cpu-steps")["summary"]
    out = []
    for greedy in (True, False):
        rows = [r for r in load("cpu-budget1024")["rows"] if r.get("greedy", False) == greedy]
        by = {r["drafter"]: r for r in rows}
        dist = steps["distributions_ms_greedy" if greedy else "distributions_ms_sampled"]

        def step(cache: str, n: int) -> float:
            key = f"{n} row{'s' if n > 1 else ''}"
            return steps[f"forward_ms_{cache}_cpu"][key] + steps["head_ms_cpu"][key] + dist[key] + \
                steps["repetition_ms"][key]

        model, ngram, none = by["model"], by["ngram"], by["none"]
        out.append(Profile(f"cpu_embedded_{'greedy' if greedy else 'sampled'}",
                           {n: step("full", n) for n in (1, 2, 3, 7)}, step("retrieval", GAMMA1 + 1),
                           step("retrieval", 1), None,
                           {"model": Level1(model["level1_step_ms"], model["level1_acceptance"],
                                            model["level1_acceptance"], 1.0, False),
                            "ngram": Level1(0.05, ngram["level1_acceptance"], ngram["level1_acceptance"], 0.7, True)},
                           none["level2_acceptance"], greedy=greedy, prompt_tokens=8000, linear=True,
                           assumed=["prompt lookup proposes for 0.7 of tokens asked, 0.05 ms a token",
                                    "level 3 beyond 7 rows on along its last segment (a CPU forward is compute-bound)"]))
    return out


def app_profile() -> list[Profile]:
    """The served app's first sampled click at 8K on a GPU (bench.served scale, random SmolLM2-135M shape): a small
    model on chip, so every level's step costs about a full one; the autoregressive step from the app's runs."""
    clicks = load("served-scale-8k-NVIDIA-H200")["app_scale"]["engine_clicks"]["sampled"]
    ar = 1e3 / clicks["ar"]["tokens_per_s"]
    return [Profile("app_gpu_sampled_8k", {1: ar, 2: 1.1 * ar, 32: 1.25 * ar}, ar, 0.95 * ar, 0.9 * ar,
                    {"ngram": Level1(0.01, 0.05, 0.05, 0.9, True)}, 0.9, 0.05, prompt_tokens=8000,
                    assumed=["level 3: 1.1x the one-row step at 2 rows, 1.25x at 32", "level 2 0.95x a full step",
                             "sampled prompt lookup on random weights accepted 0.05", "a2 0.9"])]


def profiles() -> list[Profile]:
    return real_profiles() + random_profiles() + cpu_profile() + app_profile()


def stood(u: list[float], alpha: float, n: int, at: int) -> int:
    """Drafts that stand of `n` proposed at answer position `at`, each with probability `alpha`, by the draws `u`
    (one per position: two policies meet the same answer, however they draft it)."""
    k = 0
    while k < n and u[(at + k) % len(u)] < alpha:
        k += 1
    return k


def jittered(rng: random.Random, ms: float) -> float:
    """A measured step: its cost, jittered, now and then stalled."""
    x = ms * rng.lognormvariate(0.0, SIGMA)
    return x * STALL_FACTOR if rng.random() < STALL else x


class Simulator:
    """Rounds of one profile under a policy, with one seed's random draws. Whether a draft stands is drawn per answer
    position (common random numbers): two policies on one seed meet the same answer, however they draft it, and
    differ by their choices, not by their luck."""

    def __init__(self, prof: Profile, seed: int):
        self.prof, self.rng = prof, random.Random(seed)
        draws = random.Random(seed + 1_000_003)
        self.u = {level: [draws.random() for _ in range(4096)] for level in (1, 3, 4)}  # level 1, level 3, the guess
        self.done = 0  # answer tokens emitted so far in the current run
        self.seen: set[tuple] = set()

    def cost(self, ms: float) -> float:
        return jittered(self.rng, ms)

    def accepted(self, alpha: float, n: int, level: int, at: int) -> int:
        """Drafts that stand of `n` proposed at answer position `at`, each with probability `alpha`."""
        return stood(self.u[level], alpha, n, at)

    def drafting(self, h: Hierarchy, want: int, slow: float = 1.0) -> tuple[Draft, int]:
        """Level 2's (or level 1's) draft of `want` tokens, its level-2 forwards `slow`er than alone: what drafting
        it took, as the engine's Draft holds it, and the tokens drafted."""
        p, draft = self.prof, Draft()
        d = p.drafters.get(h.level1)
        if not h.level2:  # level 1 for level 3 directly (nothing drafted: autoregressive)
            proposed = want if d and self.rng.random() < d.offered else 0
            if d and want:
                draft.asked, draft.level1_s = want, self.cost(want * d.ms) / 1e3
            return draft, proposed
        if d is None and p.chained is not None:
            draft.forwards.append(Forwards(want, 1, self.cost(want * p.chained * slow), chained=True))
            return draft, want
        tokens = 0
        while tokens < want:
            asked = min(h.gamma1, want - tokens) if d else 0
            proposed = asked if d and self.rng.random() < d.offered else 0
            kept = self.accepted(d.a1, proposed, 1, self.done + tokens) if d else 0
            if asked:
                draft.asked += asked
                draft.level1_s += self.cost(asked * d.ms) / 1e3
                draft.checks.append((asked, proposed, kept))
            ms = p.level2_one + (p.level2 - p.level2_one) * proposed / GAMMA1
            draft.forwards.append(Forwards(1, proposed + 1, self.cost(ms * slow)))
            tokens += kept + 1
        return draft, min(tokens, want)

    def run(self, policy, tokens: int) -> tuple[int, float]:
        """A run of `tokens` new tokens: (tokens emitted, decoding milliseconds)."""
        p, done, wall, ready = self.prof, 0, 0.0, None
        self.done = 0
        while done < tokens:
            h = policy.choose()
            want = min(h.gamma2, tokens - done)
            record = RoundRecord(h)
            if ready is not None and ready == h:
                drafted = want  # its drafting is in the record of the round that made it
            else:
                draft, drafted = self.drafting(h, want)
                record.took(draft)
            if h.level2:
                record.sync_ms = self.cost(p.overhead)
            d = p.drafters.get(h.level1)
            alpha = p.a2 if h.level2 else d.a13 if d else 0.0
            accepted = self.accepted(alpha, drafted, 3, done)
            if h.level1 and not h.level2 and record.level1_asked:
                record.level1_checks.append((3, record.level1_asked, drafted, accepted))
            rows = drafted + 1
            first = (h.level2, rows) not in self.seen
            self.seen.add((h.level2, rows))
            step = self.cost(p.step3(rows)) * (1.5 if first and p.streamed else 1.0)  # a first use's one-time work
            after = min(h.gamma2, tokens - done - drafted - 1)
            ready, emitted = None, accepted + 1
            if h.ahead and drafted and after > 0:
                made, _ = self.drafting(h, after + 1, p.beside)  # the guess and the next draft, beside the pass
                record.level3_wall_ms = max(step - p.post, (made.level1_s + made.level2_s) * 1e3) + p.post
                record.level3_ms, record.post_ms = step, p.post
                record.took(made, beside=True)
                if accepted == drafted:
                    record.guess = self.u[4][(done + drafted) % len(self.u[4])] < p.a2
                    ready = h if record.guess else None
            else:
                record.level3_ms = record.level3_wall_ms = step
            record.rows, record.drafted, record.accepted = rows, drafted, accepted
            if policy.in_passing:
                record.in_passing = self.in_passing(h, emitted)
            policy.observe(record)
            wall += record.level1_ms + record.level2_ms + record.level3_wall_ms + record.overhead_ms
            done += emitted
            self.done = done
        return done, wall

    def in_passing(self, h: Hierarchy, emitted: int) -> dict:
        """What the drafters asked in passing would have proposed, checked against the `emitted` tokens."""
        out = {}
        for name, d in self.prof.drafters.items():
            if d.in_passing and name != h.level1:
                proposed = SHADOW_GAMMA if self.rng.random() < d.offered else 0
                kept = self.accepted(d.a13, min(proposed, emitted), 1, self.done)
                out[name] = ([(SHADOW_GAMMA, proposed, kept)], 0.01)
        return out


# The engine's warm-up on a short text (about 700 tokens) before a first request, as the cost book sees it: TriForce
# drafting the longest level-3 draft (every decode-step size compiles then), TriForce at its default γ2, and an
# autoregressive run; then the request's own Compare click: an autoregressive run on the document, then method auto.
WARM_UP = ((AUTO_GAMMA2, WARM_TOKENS), (6, WARM_TOKENS), (0, AR_TOKENS))
SHORT_TOKENS, SHORT_COST = 700, 0.8  # the warm-up's text, and its steps' cost against the document's (assumed)


def luckier(prof: Profile) -> Profile:
    """The same regime on an answer whose drafts matched more: level 2 accepted more (0.99 where the next answer saw
    0.95, on the real pair) and level 1 far more (prompt lookup 0.37 where the next answer quoted nothing: 0.09)."""
    drafters = {name: replace(d, a1=min(0.95, 0.3 + d.a1), a13=min(0.95, 0.3 + d.a13))
                for name, d in prof.drafters.items()}
    return replace(prof, a2=min(0.995, prof.a2 + 0.05), drafters=drafters)


class Book:
    """The planner's cost book through the warm-up and the Compare click."""

    def __init__(self, prof: Profile):
        self.prof = prof
        self.book = CostBook()

    def policy(self, plan: Hierarchy | None, prompt_tokens: int):
        """Method auto (`plan` None) or a fixed plan, starting from the book; its estimates are learnt after."""
        prof, drafters = self.prof, list(self.prof.drafters)
        passing = [n for n, d in prof.drafters.items() if d.in_passing]
        regime = Regime.of(prof.streamed, prompt_tokens, prof.greedy)
        e = self.book.estimates(regime, 4096, drafters, passing)
        self.learn = lambda: self.book.learn(regime, 4096, e)
        if plan is not None:
            return Fixed(plan, e)
        return Auto(e, drafters, GAMMA1, AUTO_GAMMA2, streamed=prof.streamed, ahead=prof.ahead,
                    chained=prof.chained is not None)

    def auto_run(self, seed: int, tokens: int, second: bool = False, before: Profile | None = None) -> float:
        """The warm-up, the Compare click's autoregressive run, then auto's run: its tokens per millisecond. With
        `second`, another question on the document was answered first, its acceptances not this answer's
        (`before`, by default `luckier`): what that answer saw is this run's prior."""
        prof = self.prof
        short = Simulator(replace(prof, level3={r: SHORT_COST * ms for r, ms in prof.level3.items()}), seed)
        level1 = next(iter(prof.drafters), "")
        for gamma2, n in WARM_UP:
            plan = Hierarchy(level1, True, GAMMA1 if level1 else 0, gamma2, prof.ahead) if gamma2 else AUTOREGRESSIVE
            short.run(self.policy(plan, SHORT_TOKENS), n)
            self.learn()
        if second:
            Simulator(before or luckier(prof), seed + 7919).run(self.policy(None, prof.prompt_tokens), tokens)
            self.learn()
        sim = Simulator(prof, seed)
        sim.run(self.policy(AUTOREGRESSIVE, prof.prompt_tokens), AR_TOKENS)
        self.learn()
        done, ms = sim.run(self.policy(None, prof.prompt_tokens), tokens)
        return done / ms


def simulate(prof: Profile, seeds: int, tokens: int, fixed: bool = True) -> dict:
    """The regime's figures over `seeds` seeds, a first answer on the document and (`second_answer`) one after
    another question's (`fixed`: with the best fixed plan in hindsight)."""
    ar = fixed_rate(prof, AUTOREGRESSIVE, seeds, tokens)
    top, best_rate = None, None
    if fixed:  # the cost model's top candidates at the true figures, each simulated: the best in hindsight
        truth = prof.figures()
        options = candidates(list(prof.drafters), GAMMA1, AUTO_GAMMA2, ahead=prof.ahead)
        rates = {h.name: fixed_rate(prof, h, seeds, tokens)
                 for h in sorted(options, key=lambda h: -(rate(h, truth) or 0.0))[:8]}
        top = max(rates, key=rates.get)
        best_rate = rates[top]
    out = {"seeds": seeds, "tokens": tokens, "ar_ms_per_token": 1.0 / ar, "assumed": prof.assumed}
    old = legacy(prof)
    for second in (False, True):
        new = statistics.mean(Book(prof).auto_run(seed, tokens, second) for seed in range(seeds))
        figures = {"auto_over_ar": new / ar}
        if (old_over_ar := old.get("second_answer" if second else "first_answer")) is not None:
            figures |= {"new_over_old": new / ar / old_over_ar, "old_over_ar": old_over_ar}
        if fixed:
            figures |= {"auto_over_best_fixed": new / best_rate, "best_fixed": top, "best_fixed_over_ar": best_rate / ar}
        if second:
            out["second_answer"] = figures
        else:
            out |= figures
    return out


def legacy(prof: Profile) -> dict[str, float]:
    """The replaced planner's rate over autoregressive decoding on this regime (first and second answer), as
    recorded: only where the regime's profile is still the one it was recorded on (a result re-recorded since
    changes the profile, and that planner's code is gone)."""
    data = json.loads((RESULTS.parent / "legacy-planner.json").read_text())
    same = data.get("profiles", {}).get(prof.name) == fingerprint(prof)
    return data["old_over_ar"].get(prof.name, {}) if same else {}


def fingerprint(prof: Profile) -> str:
    """A digest of everything a profile holds (its figures to 6 significant digits)."""
    def rounded(x):
        if isinstance(x, float):
            return float(f"{x:.6g}")
        if isinstance(x, dict):
            return {str(k): rounded(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [rounded(v) for v in x]
        return x
    return hashlib.sha256(json.dumps(rounded(asdict(prof)), sort_keys=True).encode()).hexdigest()[:16]


def fixed_rate(prof: Profile, h: Hierarchy, seeds: int, tokens: int) -> float:
    """Tokens per millisecond of a fixed plan, mean over seeds."""
    runs = [Simulator(prof, seed).run(Fixed(h, book_free()), tokens) for seed in range(seeds)]
    return statistics.mean(t / ms for t, ms in runs)


def book_free():
    """Estimates for a fixed plan that learns nothing kept (the comparison runs)."""
    return CostBook().estimates(Regime(False, 1, False), 4096)


# Recorded traces: each case bench.planner measured on real weights, replayed from its own runs' rounds


def medians(samples: dict[int, list[float]]) -> dict[int, float]:
    return {k: statistics.median(v) for k, v in sorted(samples.items()) if v}


def trace_profile(name: str, case: dict, streamed: bool, gpu: bool) -> Profile:
    """One recorded case's truth from its runs' rounds: level 3 by rows (the AR run's steps and each fixed plan's
    full drafts), a level-2 forward drafting alone (the levels 2 → 3 runs) and checking level 1 (prompt lookup's
    run), each level-1 drafter's figures from its fixed run, level 2's acceptance from the levels 2 → 3 runs."""
    runs = case["runs"]
    level3: dict[int, list[float]] = {}
    alone, checking, a2 = [], [], []
    for plan, r in runs.items():
        if plan == "auto" or "ahead" in plan:
            continue
        for (l1, l2, l3, _, forwards), (drafted, _) in zip(r["rounds"], r["verified"]):
            if plan == "ar" or drafted == r["gamma2"]:
                level3.setdefault(drafted + 1, []).append(l3)
            if forwards and plan.startswith("levels 2"):
                alone.append(l2 / forwards)
            elif forwards and plan.startswith("levels 1"):
                checking.append(l2 / forwards)
        if plan.startswith("levels 2") and r["level2_acceptance"]:
            a2.append(r["level2_acceptance"])
    level2_one = statistics.median(alone)
    drafters = {}
    for plan, drafter in (("levels 1→2→3 lookup", "ngram"), ("levels 1→2→3 draft model", "model")):
        if (r := runs.get(plan)) is not None:
            asked = max(1, sum(f for *_, f in r["rounds"]) * r["gamma1"])
            drafters[drafter] = Level1(sum(x[0] for x in r["rounds"]) / asked, r["level1_acceptance"],
                                       r["level1_acceptance"], min(1.0, r["level1_proposed"] / asked),
                                       drafter == "ngram")
    assumed = ["a level-1 token asked costs its run's level-1 time over γ1 per level-2 check", "a13 = a1",
               "level 3 accepts level 2's guess as often as a draft (a2)"]
    if streamed:
        assumed += ["level 2 beside the pass as fast as alone", "nothing follows the pass"]
    return Profile(name, medians(level3), statistics.median(checking) if checking else level2_one, level2_one,
                   level2_one if gpu else None, drafters, statistics.fmean(a2), streamed=streamed,
                   ahead=streamed and gpu, greedy=case["sampling"] == "greedy",
                   prompt_tokens=runs["ar"]["prompt_tokens"], linear=not gpu, assumed=assumed)


def trace_batch(name: str, case: dict, requests: int) -> BatchProfile:
    """One recorded batch case's truth: level 3 at the AR rounds and at a fixed γ2's, level 2 per step, its
    acceptance."""
    runs = case["runs"]
    g = max(GAMMAS_TRACED, key=lambda g: bool(runs.get(f"levels 2→3 γ2 {g}", {}).get("level2_step_ms")))
    fixed = runs[f"levels 2→3 γ2 {g}"]
    return BatchProfile(name, requests, fixed["prompt_tokens"], {requests: runs["ar"]["level3_ms"],
                                                                   requests * (g + 1): fixed["level3_ms"]},
                        fixed["level2_step_ms"], min(fixed["level2_acceptance"] or 0.0, 0.995),
                        case["sampling"] == "greedy", ["a level-2 step for fewer requests costs what it did for all"])


GAMMAS_TRACED = (4, 8, 2, 16)  # the levels 2 → 3 runs a batch's costs are read from, the first recorded


def replay_traces(seeds: int) -> dict[str, list[dict]]:
    """Each recorded case of bench.planner (bench/results/planner-real-*.json): auto's measured ratio over AR beside
    the one its replay predicts (a case after another answer replayed after the first answer's case)."""
    out = {}
    for file in sorted(RESULTS.glob("planner-real-*.json")):
        data, rows = json.loads(file.read_text()), []
        gpu = data.get("device", "cpu") != "cpu"
        for regime, entry in data["regimes"].items():
            scn, first = entry["scenario"], {}
            for case in entry["cases"]:
                label = f"{regime} {case['doc']} {case['sampling']} {case['new_tokens']}"
                tokens, second = case["new_tokens"], case["answer"] != "first"
                if scn["requests"] > 1:
                    prof = trace_batch(label, case, scn["requests"])
                    figures = simulate_batch(prof, seeds, tokens)
                    predicted = (figures["second_batch"] if second else figures)["auto_over_ar"]
                else:
                    prof = trace_profile(label, case, scn["offload"], gpu)
                    first.setdefault(label, prof)
                    ar = fixed_rate(prof, AUTOREGRESSIVE, seeds, tokens)
                    auto = [Book(prof).auto_run(s, tokens, second, first[label] if second else None)
                            for s in range(seeds)]
                    predicted = statistics.mean(auto) / ar
                rows.append({"regime": regime, "doc": case["doc"], "sampling": case["sampling"],
                             "new_tokens": tokens, "answer": case["answer"], "measured": case["auto_over_ar"],
                             "predicted": predicted, "error": predicted / case["auto_over_ar"] - 1})
                print(f"{file.stem} {label} {case['answer']}: auto/AR measured {case['auto_over_ar']:.3f}, "
                      f"predicted {predicted:.3f}", flush=True)
        out[file.stem] = rows
    return out


# Batched regimes: a batch's rounds under core.plan.policy.BatchAuto, from the rounds bench.batch recorded


BATCH_GAMMAS = (1, 2, 3, 4, 6, 8, 12, 16)  # the fixed γ2s a batch is compared with (method triforce, drafter none)


@dataclass
class BatchProfile:
    """One batched regime's truth: `requests` decoding together, level 3's milliseconds by the rows it verifies
    (between recorded sizes linear, beyond them on along the last segment), a level-2 step's for the requests it
    drafts for (recorded at all of them; fewer assumed to cost the same: a bound), level 3's acceptance of level 2."""

    name: str
    requests: int
    prompt_tokens: int
    level3: dict[int, float]
    level2: float
    alpha: float
    greedy: bool
    assumed: list[str] = field(default_factory=list)

    def step3(self, rows: int) -> float:
        (a, ma), (b, mb) = sorted(self.level3.items())[:2]
        return ma + (mb - ma) * (rows - a) / (b - a)


def batch_profiles() -> list[BatchProfile]:
    """Each batched setting whose rounds bench.batch recorded (level 3 at the autoregressive and the fixed-γ2 rounds,
    level 2 per step), greedy and sampled; random weights (which accept every draft) also at a real model's
    acceptance, REAL_ALPHA."""
    out = []
    for file in sorted(RESULTS.glob("batch-*.json")):
        for name, v in json.loads(file.read_text())["results"].items():
            runs, n = v["runs"], v["requests"]
            for sampled in (False, True):
                ar, tf = runs.get("ar_sampled" if sampled else "ar"), runs.get("triforce_sampled" if sampled else
                                                                                "triforce")
                tf = tf or runs.get("triforce")  # a sampled fixed run not recorded: the greedy one's costs
                if not ar or not tf or not ar.get("level3_ms") or not tf.get("level2_step_ms"):
                    continue
                gamma2 = v["settings"].get("gamma2") or 6
                assumed = ["a level-2 step for fewer requests costs what it did for all of them"]
                if tf is runs.get("triforce") and sampled:
                    assumed.append("the sampled fixed run's costs are the greedy one's")
                alpha = tf["level2_acceptance"]
                label = f"batch_{name.replace('-', '_')}_{'sampled' if sampled else 'greedy'}"
                base = BatchProfile(label, n, v["prompt_tokens"], {n: ar["level3_ms"], n * (gamma2 + 1):
                                                                    tf["level3_ms"]}, tf["level2_step_ms"],
                                    min(alpha, 0.995), not sampled, assumed)
                out.append(base)
                if alpha > 0.99:  # random weights: also at what a real model accepts
                    out.append(replace(base, name=f"{label}_at_{REAL_ALPHA}", alpha=REAL_ALPHA,
                                       assumed=[*assumed, f"acceptance {REAL_ALPHA} (the real pair's; random "
                                                          f"weights accepted {alpha:.2f})"]))
    return out


class BatchSimulator:
    """Rounds of one batched profile under a batch policy, one seed's draws: whether a draft stands is drawn per
    request and answer position (common random numbers), each step's cost jittered and now and then stalled."""

    def __init__(self, prof: BatchProfile, seed: int):
        self.prof, self.rng = prof, random.Random(seed)
        draws = random.Random(seed + 1_000_003)
        self.u = [[draws.random() for _ in range(1024)] for _ in range(prof.requests)]

    def run(self, policy: BatchAuto, tokens: int, fixed: int | None) -> float:
        """Every request answering `tokens` tokens, planned (`fixed` None: method auto) or at γ2 `fixed` (0: ar):
        the batch's tokens per millisecond."""
        p, done, ms, seen = self.prof, [0] * self.prof.requests, 0.0, [(0, 0)] * self.prof.requests
        while (live := [i for i in range(p.requests) if done[i] < tokens]):
            asks = [Ask(fixed is None, AUTO_GAMMA2 if fixed is None else fixed, True, *seen[i],
                        p.prompt_tokens + done[i], 4096, p.greedy) for i in live]
            gammas = [min(g, tokens - done[i] - 1) for g, i in zip(policy.choose(asks), live)]
            level2 = sum(jittered(self.rng, p.level2) for j in range(max(gammas)))
            rows = sum(g + 1 for g in gammas)
            level3 = jittered(self.rng, p.step3(rows))
            verdicts = []
            for g, i in zip(gammas, live):
                k = stood(self.u[i], p.alpha, g, done[i])
                done[i] += k + 1
                if g:
                    seen[i] = (seen[i][0] + k + (k < g), seen[i][1] + k)
                    verdicts.append((g, k))
            policy.observe(BatchRecord(rows, level3, sum(1 for g in gammas if g), max(gammas), level2,
                                       tuple(verdicts)))
            ms += level2 + level3
        return sum(done) / ms


def simulate_batch(prof: BatchProfile, seeds: int, tokens: int) -> dict:
    """A batched regime's figures over `seeds` seeds: method auto over batched AR and over the best fixed γ2 in
    hindsight, on a first batch after the engine's warm-up and on a next one."""
    def mean(plan: int) -> float:
        return statistics.mean(BatchSimulator(prof, s).run(BatchAuto(CostBook()), tokens, plan) for s in range(seeds))

    def auto(seed: int, before: int | None) -> float:
        """Method auto's batch after the engine's warm-up batches (Engine.warm_up: a fixed γ2 and an autoregressive
        one on its short text, whose steps cost SHORT_COST of these) and, with `before`, a batch of
        method auto first (`before` tokens each)."""
        book, short = CostBook(), replace(prof, level3={r: SHORT_COST * ms for r, ms in prof.level3.items()},
                                           level2=SHORT_COST * prof.level2, prompt_tokens=SHORT_TOKENS)
        for plan in (6, 0):
            warm = BatchAuto(book)
            BatchSimulator(short, seed).run(warm, WARM_TOKENS, plan)
            warm.finish()
        if before:
            earlier = BatchAuto(book)
            BatchSimulator(prof, seed + 7919).run(earlier, before, None)
            earlier.finish()
        return BatchSimulator(prof, seed).run(BatchAuto(book), tokens, None)

    ar = mean(0)
    fixed = {g: mean(g) for g in BATCH_GAMMAS}
    top = max(fixed, key=fixed.get)
    first = statistics.mean(auto(s, None) for s in range(seeds))
    second = statistics.mean(auto(s, tokens) for s in range(seeds))
    return {"seeds": seeds, "tokens": tokens, "requests": prof.requests, "alpha": prof.alpha,
            "ar_tokens_per_ms": ar, "auto_over_ar": first / ar, "auto_over_best_fixed": first / fixed[top],
            "best_fixed": f"γ2 {top}", "best_fixed_over_ar": fixed[top] / ar, "assumed": prof.assumed,
            "second_batch": {"auto_over_ar": second / ar, "auto_over_best_fixed": second / fixed[top]}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--only", nargs="*", help="regimes to simulate (default: all)")
    args = p.parse_args(argv)
    results = {}
    regimes = [(prof, simulate, "second_answer", "after another answer") for prof in profiles()] + \
        [(prof, simulate_batch, "second_batch", "a next batch") for prof in batch_profiles()]
    for prof, run, again, then in regimes:
        if args.only and prof.name not in args.only:
            continue
        results[prof.name] = r = run(prof, args.seeds, args.tokens)
        s = r[again]
        print(f"{prof.name:26s} auto/AR {r['auto_over_ar']:.3f}  auto/best fixed {r['auto_over_best_fixed']:.3f}  "
              f"new/old {r.get('new_over_old', float('nan')):.3f}  | {then}: {s['auto_over_ar']:.3f} "
              f"{s['auto_over_best_fixed']:.3f} {s.get('new_over_old', float('nan')):.3f}  (best fixed: "
              f"{r['best_fixed']}, {r['best_fixed_over_ar']:.2f}x)", flush=True)
    summary = {name: {k: r[k] for k in ("auto_over_ar", "auto_over_best_fixed", "new_over_old") if k in r}
               for name, r in results.items()}
    traces = replay_traces(args.seeds)
    summary |= {f"traces_{stem}": {"worst_error": max((abs(r["error"]) for r in rows), default=None)}
                for stem, rows in traces.items()}
    print(save("simulate", {**environment(), "regimes": results, "traces": traces,
                            "summary": {"simulate": summary}}))


if __name__ == "__main__":
    main()
