"""The hierarchical loop: level 1 drafts, level 2 (target + retrieval cache) verifies and drafts for level 3
(target + full cache), each verification exact speculative sampling; a planner may leave out levels round by
round (core.plan.planner)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Generator, Iterator, Sequence, TypeVar

import torch

from core.decode.autoregressive import next_token
from core.config import GenerationConfig
from core.decode.graphs import Graphs, clock
from core.decode.drafters import Drafter
from core.events import Acceptance, DraftProposal, Event, Footprint, PlanChosen, Provenance, StepTiming, Verdict
from core.cache.kvcache import KVCache
from core.decode.levels import Level, common_prefix
from core.decode.output import Output
from core.model import parallel
from core.model.parallel import agree
from core.plan.planner import Estimates, Hierarchy, Planner
from core.decode.repetition import Repetition
from core.cache.retrieval import Retrieval
from core.decode.sampling import distributions, draw, residual_distribution, speculative_verify


T = TypeVar("T")

SHADOW_GAMMA = 4  # tokens a drafter is asked for in passing (TriForce.shadow): within the γs auto mostly takes


@dataclass
class Draft:
    """What level 2 hands level 3 in one round: its tokens, their distributions q and provenance, and the time
    levels 1 and 2 took."""

    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    provenance: list[Provenance] = field(default_factory=list)
    level1_s: float = 0.0
    level2_s: float = 0.0
    asked: int = 0  # level-1 tokens asked for (whether proposed or not: a drafter's cost is per token asked)
    level2_forwards: int = 0
    checks: list[tuple[int, int]] = field(default_factory=list)  # level 2's checks of level 1: (proposed, accepted)
    feature: torch.Tensor | None = None  # level 2's hidden state that produced the last token

    def cost_with(self, other: Draft) -> Draft:
        """The drafting both took: their times, tokens asked and forwards summed (no tokens)."""
        return Draft(level1_s=self.level1_s + other.level1_s, level2_s=self.level2_s + other.level2_s,
                     asked=self.asked + other.asked, level2_forwards=self.level2_forwards + other.level2_forwards)


@dataclass
class Ahead:
    """Level 2's draft of the next round, made while level 3 verified this one after level 2's `guess` at the token
    level 3 would emit next (drawn from `q`, and checked like one more draft); its events held back until a round
    uses it."""

    plan: Hierarchy
    guess: int
    q: torch.Tensor
    draft: Draft
    events: list[Event]
    cost: Draft  # the time and forwards it took, the guess's too (no tokens)


def drafts_ahead(setting: str, streamed: bool, device: torch.device) -> bool:
    """Whether level 2 drafts ahead under `setting` (GenerationConfig.draft_ahead): auto where level 3's pass waits
    on copies from CPU memory to a GPU, and not under tensor parallelism, whose ranks must run their collectives in
    one order."""
    return setting == "on" or (setting == "auto" and streamed and device.type == "cuda" and parallel.ACTIVE is None)


class Overlap:
    """Level 3 on a stream of its own, so that level 2 drafts ahead meanwhile: a GPU runs both at once, and a pass
    over a cache streamed from CPU memory mostly waits on its copies. Elsewhere the two run one after the other."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.host_ms = 0.0

    @contextlib.contextmanager
    def level3(self) -> Iterator[None]:
        """Queue level 3's work on its stream (after everything queued before it)."""
        t0 = time.perf_counter()
        if self.stream is None:
            yield
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            self.start.record(self.stream)
            with torch.cuda.stream(self.stream):
                yield
            self.end.record(self.stream)
        self.host_ms = (time.perf_counter() - t0) * 1e3

    def join(self, *tensors: torch.Tensor) -> None:
        """Make the current stream wait for level 3 before it reads `tensors`, which level 3 computed."""
        if self.stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self.stream)
            for t in tensors:
                t.record_stream(current)

    def level3_ms(self) -> float:
        """What level 3's work took, once done (the host waits for it): on a GPU its stream's time, else the
        host's."""
        if self.stream is None:
            return self.host_ms
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


class TriForce:
    """One generation: rounds of level-3 verification until `out` says stop. The target level's full cache must
    hold prompt[:-1]; `queries` are the ones its prefill recorded for the last prompt row (the first selection);
    `drafters`: level 1's, by name (none: level 2 drafts alone), the first the default;
    `retrieval_cache`: where level 2's cache goes (core.cache.memory sizes it); `index_device`: where the chunk index is
    kept (default: the model's device). Given `estimates` (method auto), a planner chooses each round's hierarchy
    from them and what it measures; without, every round is TriForce's 1 → 2 → 3 (2 → 3 with drafter none) at the
    settings' γs, and the planner only records what the levels cost and accepted."""

    def __init__(self, target: Level, prompt: list[int], queries: list[torch.Tensor], drafters: dict[str, Drafter],
                 cfg: GenerationConfig, generator: torch.Generator, out: Output, retrieval_cache: KVCache,
                 graphs: Graphs | None = None, index_device: torch.device | None = None,
                 estimates: Estimates | None = None):
        self.target, self.prompt, self.queries, self.drafters = target, prompt, queries, drafters
        self.graphs = graphs
        self.cfg, self.generator, self.out = cfg, generator, out
        level1 = next(iter(drafters), "")
        model = target.model
        self.retrieval = Retrieval(target.cache, cfg, retrieval_cache, model.ops, index_device)
        self.auto = estimates is not None
        streamed = not target.cache.resident
        ahead = drafts_ahead(cfg.draft_ahead, streamed, model.device)
        fixed = Hierarchy(level1, True, cfg.gamma1 if level1 else 0, cfg.gamma2, ahead)
        self.overlap = Overlap(model.device)
        self.repetition = Repetition(cfg, model.args.vocab_size, model.device, len(prompt))  # levels 2 and 3 alike
        # Level 2 drafting alone chains its forwards on the device (draft_alone), unless repetition control must see
        # each drafted id on the host, or tensor-parallel ranks must agree on each draw.
        self.chains = not self.repetition.active and parallel.ACTIVE is None
        self.planner = Planner(estimates or Estimates(), list(drafters), cfg.gamma1, cfg.gamma2, streamed=streamed,
                               level2=self.retrieval.n_select < self.retrieval.index.num_chunks,
                               ahead=ahead and self.overlap.stream is not None,
                               fixed=None if self.auto else fixed, chained=self.chains and graphs is not None)
        self.level2 = Level(model, self.retrieval.cache, prompt[:-1], graphs, drafting=True)
        self.counts = Acceptance()
        self.plans: list[str] = []  # the planner's choices, in order
        self.pending: dict[str, tuple[list[int], int]] = {}  # shadow: a proposal in passing, and its tokens matched
        self.ahead_made = self.ahead_kept = 0  # next-round drafts level 2 made ahead, and those a round used

    def prepare(self) -> Iterator[Event]:
        """Before decoding: level 2's first selection, with the queries the prefill recorded for the last prompt
        row (part of filling the caches, as in the paper; a first use of new sizes may compile kernels)."""
        yield self.retrieval.select(self.queries, -1, 0, self.target.cache.seq_len)

    def run(self) -> Iterator[Event]:
        """The rounds' events: plans, proposals, verdicts, tokens, selections, timings."""
        cfg, target, retrieval = self.cfg, self.target, self.retrieval
        seq = list(self.prompt)
        round_ = 0
        feature = None  # the target's hidden state that produced seq's last token (none for the prompt's)
        shown = None  # the plan the last PlanChosen named
        ready: Ahead | None = None  # this round's draft, if level 2 made it during the last verification
        while not self.out.done:
            h = self.planner.choose()
            if self.auto:  # timings differ between tensor-parallel ranks: all follow rank 0's choice
                names = ["", *self.drafters]
                mine = (names.index(h.level1), h.level2, h.gamma1, h.gamma2, h.ahead)
                if (agreed := agree(*mine)) != mine:
                    h = Hierarchy(names[agreed[0]], bool(agreed[1]), agreed[2], agreed[3], bool(agreed[4]))
            if self.auto and h != shown:
                shown = h
                self.plans.append(h.name)
                yield PlanChosen(round_, h.name, self.planner.reason, h.level1, h.level2, h.gamma1, h.gamma2, h.ahead)
            committed = len(seq)
            t0 = clock(self.graphs)
            if h.level2:  # level 2's cache takes what level 3 verified since it was last in step, whatever drafted it
                self.keep_level2_in_step(seq)
            sync_s = clock(self.graphs) - t0
            if ready is not None and ready.plan == h:
                draft, spent = ready.draft, Draft()  # its cost was counted in the round that made it
                self.ahead_kept += 1
                yield from ready.events
            else:
                draft = spent = yield from self.draft(h, seq, committed, round_, feature)
            ready = None
            for proposed, accepted in draft.checks:
                self.counts.count(1, proposed, accepted)
            t0 = clock(self.graphs)
            captured = self.graphs.capture_s if self.graphs is not None else 0.0
            reselect = h.level2 and retrieval.policy.due(round_)
            n = len(draft.tokens)
            # the next round's draft length should level 3 accept all of this one (then it emits n + 1 tokens)
            after = min(h.gamma2, self.cfg.max_new_tokens - len(self.out.ids) - n - 1)
            made = None  # the next round's draft, if level 2 drafts ahead during this verification
            if n or reselect:
                ahead = h.ahead and not reselect and after > 0
                with self.overlap.level3() if ahead else contextlib.nullcontext():
                    h3 = target.states(seq, n + 1, committed, draft.tokens, record=n + 1 if reselect else 0)
                if ahead:
                    made = self.draft_ahead(h, seq, committed, draft, round_ + 1, after)
                    self.overlap.join(h3)
                    pass_ms = self.overlap.level3_ms()  # waits for the pass: what follows it is timed alone
                    after_pass = clock(self.graphs)
                p3 = distributions(self.repetition(target.head(h3), seq, draft.tokens), cfg)
                # level 2's guess joins the draft, checked against level 3's row after it (which would otherwise
                # give the bonus token): it stands as often as level 3 accepts a draft
                tokens, q = (draft.tokens + [made.guess], draft.q + [made.q]) if made else (draft.tokens, draft.q)
                accepted, token = speculative_verify(tokens, torch.stack(q) if q else None, p3, self.generator)
                feature = h3[accepted]
            else:  # nothing to verify: the step method ar takes (the same draw: verifying no drafts samples p)
                accepted, (token, h3, _) = 0, next_token(target, seq, self.repetition, cfg, self.generator)
                feature = h3[0]
            level3_s = clock(self.graphs) - t0
            level3_ms, post_ms = level3_s * 1e3, None
            # drafting ahead, level 3's own time is its pass (its stream's time) and what followed the pass, unless a
            # first capture (warm-up) fell in the drafting beside it
            if made is not None:
                self.ahead_made += 1
                fresh = self.graphs is not None and self.graphs.capture_s != captured
                post_ms = (clock(self.graphs) - after_pass) * 1e3
                level3_ms = level3_ms - (made.cost.level1_s + made.cost.level2_s) * 1e3 if fresh \
                    else pass_ms + post_ms
                hit = accepted == n and token == made.guess  # (a rejected guess has no residual mass)
                if accepted == n:
                    self.planner.guessed(hit)
                ready = made if hit else None
            self.counts.count(2 if h.level2 else 1, n, accepted)  # (level 1's drafts checked by level 3 directly)
            if h.level2:
                self.planner.level2_checked(n, accepted)
            elif h.level1 and draft.asked:
                self.planner.level1_checked(h.level1, 3, draft.asked, n, accepted)
            if self.auto:
                self.shadow(h, seq, draft.tokens[:accepted] + [token])
            yield Verdict(3, round_, draft.tokens, accepted, token, accepted == n)
            seq += draft.tokens[:accepted] + [token]
            yield self.out.add(draft.tokens[:accepted] + [token], draft.provenance[:accepted] + ["level3"], round_)
            selection_s = 0.0
            if reselect and not self.out.done:
                event = retrieval.select(target.queries, accepted, round_ + 1, committed + accepted)
                selection_s = event.seconds
                yield event
            # the planner learns what the drafting this round did cost, level 2's alone and beside level 3's pass
            # apart; the timeline shows what the round waited on (drafting ahead ran during level 3's wait)
            beside = made.cost if made is not None else Draft()
            drafted = spent.cost_with(beside)
            self.planner.observe(h.level1, drafted.asked, drafted.level1_s * 1e3, spent.level2_forwards,
                                 spent.level2_s * 1e3, n + 1, level3_ms, (sync_s + selection_s) * 1e3,
                                 beside.level2_forwards, beside.level2_s * 1e3, post_ms)
            yield StepTiming(round_, spent.level1_s * 1e3, (spent.level2_s + sync_s) * 1e3, level3_s * 1e3,
                             selection_s * 1e3, accepted + 1, draft.level2_forwards)
            round_ += 1

    def keep_level2_in_step(self, seq: list[int]) -> None:
        """Drop level 2's rejected tokens and give every token the full cache holds since the last time the full
        cache's keys and values: the ones level 2 drafted, and those of rounds it sat out."""
        retrieval, level2 = self.retrieval, self.level2
        valid = common_prefix(self.target.tokens, seq, retrieval.synced, len(seq))
        keep = common_prefix(level2.tokens, seq, retrieval.synced, valid)
        level2.cache.truncate(keep)
        del level2.tokens[keep:]
        if valid > retrieval.synced:
            level2.tokens.extend(seq[keep:valid])
            retrieval.copy_from_full(valid)

    def shadow(self, h: Hierarchy, seq: list[int], emitted: list[int]) -> None:
        """Ask each drafter that needs no model (prompt lookup: microseconds a token), unless it drafted this round,
        what it would have drafted, as levels 1 → 3 at γ SHADOW_GAMMA would ask it: each proposal is checked against
        the tokens level 3 emits, this round and the next ones, up to a mismatch or its end, and the next one is
        asked for at the token after. The planner learns the drafter's cost and acceptance without running it.
        Sampled too, a proposal x matches the emitted token with probability p(x), the probability that level 3
        accepts x. Checked only within a round, the proposals of one-token (autoregressive) rounds would show their
        first tokens alone, which a match's continuation predicts better than its later ones."""
        for name, drafter in self.drafters.items():
            if not drafter.in_passing:
                continue
            if name == h.level1:  # its own round measured it; a proposal in passing starts afresh after
                self.pending.pop(name, None)
                continue
            t0, checks = time.perf_counter(), []
            tokens, matched = self.pending.pop(name, (None, 0))
            for i, token in enumerate(emitted):
                if tokens is None:
                    tokens, matched = drafter.propose(seq, SHADOW_GAMMA, len(seq), emitted[:i]).tokens, 0
                if matched < len(tokens) and tokens[matched] == token:
                    matched += 1
                else:  # level 3's correction, or the bonus token after the whole proposal
                    checks.append((SHADOW_GAMMA, len(tokens), matched))
                    tokens = None
            if tokens is not None:
                self.pending[name] = (tokens, matched)
            self.planner.shadowed(name, checks, (time.perf_counter() - t0) * 1e3)

    def footprint(self) -> Footprint:
        """Acceptance at both levels, the default drafter and its forwards, the retrieval and level-1 caches' bytes,
        the planner's choices."""
        name = next(iter(self.drafters), "none")
        drafter = self.drafters.get(name)
        level1 = drafter.level if drafter else None
        return Footprint(self.counts, name, drafter.steps if drafter else 0, self.retrieval.cache.nbytes,
                         level1.cache.nbytes if level1 else 0, level1.model.step_weight_bytes() if level1 else 0,
                         plans=self.plans, ahead_made=self.ahead_made, ahead_kept=self.ahead_kept)

    def measured(self) -> Estimates:
        """What the steps of each level took in this run and the acceptances it saw (a fixed hierarchy's too: the
        warm-up's offloaded runs, or a Compare click of method triforce, give method auto its first priors)."""
        if self.planner.level2:
            return self.planner.estimates
        # Level 2 kept the whole prompt, as level 3 does, so level 3 accepted nearly all it drafted: that says nothing
        # of a prompt retrieval must cut (the warm-up's short text had given a 30K-token document's first run a prior
        # of 0.99, where it saw 0.95), so the next run keeps its default prior.
        return replace(self.planner.estimates, a2=Estimates().a2)

    def draft(self, h: Hierarchy, seq: list[int], committed: int, round_: int, feature: torch.Tensor | None
              ) -> Generator[Event, None, Draft]:
        """What the round's hierarchy gives level 3 to check: level 2's tokens, level 1's directly, or nothing
        (autoregressive); never more than the answer still wants (the length depends on the emitted count alone, so
        verification stays exact)."""
        want = min(h.gamma2, self.cfg.max_new_tokens - len(self.out.ids))
        if h.level2:
            return (yield from self.draft_level2(seq, committed, round_, feature, h.level1, h.gamma1, want))
        draft = Draft()
        if h.level1 and want:
            t0 = clock(self.graphs)
            proposal = self.drafters[h.level1].propose(seq, want, committed, (), feature)
            draft.tokens, draft.asked = proposal.tokens, want
            if proposal.tokens:  # a copied token's q is one-hot (part of level 1's cost)
                q = proposal.q if proposal.q is not None else \
                    torch.nn.functional.one_hot(torch.tensor(proposal.tokens, device=self.target.model.device),
                                                self.target.model.args.vocab_size).float()
                draft.q = list(q)
                draft.provenance = ["copy" if c else "draft" for c in proposal.copied]
            draft.level1_s = clock(self.graphs) - t0
            if proposal.tokens:
                yield DraftProposal(round_, proposal.tokens, proposal.copied)
        return draft

    def chained(self, level1: str) -> bool:
        """Whether level 2, drafting with level-1 drafter `level1` ("": alone), chains its forwards (draft_alone)."""
        return not level1 and self.chains

    def draft_level2(self, seq: list[int], committed: int, round_: int, feature: torch.Tensor | None, level1: str,
                     gamma1: int, want: int, prefix: Sequence[int] = ()) -> Generator[Event, None, Draft]:
        """Level 2 produces `want` tokens after seq + `prefix`, verifying up to `gamma1` proposals of drafter `level1`
        ("": none) per forward; yields events, returns the draft. `feature`: the hidden state that produced the last
        token, for a drafter that uses it."""
        if self.chained(level1):
            return (yield from self.draft_alone(seq, committed, round_, want, prefix))[1]
        cfg, level2 = self.cfg, self.level2
        gamma1 = gamma1 if level1 else 0
        draft = Draft(feature=feature)
        while len(draft.tokens) < want:
            t0 = clock(self.graphs)
            asked = min(gamma1, want - len(draft.tokens))
            before = [*prefix, *draft.tokens]
            proposals, q1, copied = self.drafters[level1].propose(seq, asked, committed, before, draft.feature) \
                if asked else ([], None, [])
            t1 = clock(self.graphs)
            h2 = level2.states(seq, len(proposals) + 1, committed, before + proposals)
            p2 = distributions(self.repetition(level2.head(h2), seq, before + proposals), cfg)
            # The residual is explicit here: the reference code samples from p2 instead, which biases level 3's q.
            accepted, token = speculative_verify(proposals, q1, p2, self.generator, residual=residual_distribution)
            draft.level1_s += t1 - t0
            draft.level2_s += clock(self.graphs) - t1
            draft.checks.append((len(proposals), accepted))
            draft.asked += asked
            draft.level2_forwards += 1
            if asked:
                self.planner.level1_checked(level1, 2, asked, len(proposals), accepted)
            if proposals:
                yield DraftProposal(round_, proposals, copied)
            yield Verdict(2, round_, proposals, accepted, token, accepted == len(proposals))
            draft.tokens += proposals[:accepted] + [token]
            draft.feature = h2[accepted]
            draft.q += list(p2[:accepted + 1])
            draft.provenance += ["copy" if c else "draft" for c in copied[:accepted]] + ["level2"]
        del draft.tokens[want:], draft.q[want:], draft.provenance[want:]
        return draft

    def draft_alone(self, seq: list[int], committed: int, round_: int, want: int, prefix: Sequence[int] = (),
                    guess: bool = False
                    ) -> Generator[Event, None, tuple[tuple[int, torch.Tensor] | None, Draft]]:
        """Level 2 drafts `want` tokens after seq + `prefix` by itself, each forward's token drawn on the device and
        fed straight into the next forward: the host queues the whole draft and waits once, where a loop over forwards
        waits after each (on the real Qwen pair a level-2 forward took 2.7 ms in that loop, 2.0 ms of it device
        work). The draws are the loop's, in its order, so the draft is the one it would make. With `guess`, the first
        token is draft_ahead's guess, not part of the draft. Returns (the guess and its q, or None; the draft)."""
        cfg, level2 = self.cfg, self.level2
        if not want + guess:
            return None, Draft()
        t0 = clock(self.graphs)
        hidden = level2.states(seq, 1, committed, prefix)
        ids, q = [], []
        for i in range(want + guess):
            if i:
                hidden = level2.follow(ids[-1])
            q.append(distributions(level2.head(hidden), cfg)[0])
            ids.append(draw(q[-1], self.generator))
        tokens = torch.cat(ids).tolist()  # the one wait
        level2.settle(tokens[:-1])
        first = (tokens.pop(0), q.pop(0)) if guess else None
        draft = Draft(tokens, q, ["level2"] * want, level2_s=clock(self.graphs) - t0, level2_forwards=want + guess,
                      feature=hidden[0])
        for token in tokens:
            yield Verdict(2, round_, [], 0, token, True)
        return first, draft

    def draft_ahead(self, h: Hierarchy, seq: list[int], committed: int, draft: Draft, round_: int, want: int
                    ) -> Ahead:
        """While level 3 verifies `draft`: level 2's guess at the token level 3 emits after it, should it accept it
        all, and the next round's draft of `want` tokens after that guess. Exact like any draft: a round uses it
        only when seq grew by exactly draft + guess, and it is then what level 2 drafts after that sequence."""
        # The guess is level 2's next token, drawn as any it drafts, and level 3 checks it like one more draft: it
        # stands with probability sum min(p3, q2), about level 2's acceptance (0.9 and more). Waiting for level 3 to
        # draw the same token instead, even the likeliest would stand only with probability p3(likeliest) (0.71-0.86
        # on the real pair, sampled).
        events: list[Event] = []
        if self.chained(h.level1):  # the guess leads the chain
            (token, q), after = _drain(self.draft_alone(seq, committed, round_, want, draft.tokens, guess=True),
                                       events)
            return Ahead(h, token, q, after, events, after.cost_with(Draft()))
        guess = _drain(self.draft_level2(seq, committed, round_, None, "", 0, 1, draft.tokens), [])  # verdict unshown
        after = _drain(self.draft_level2(seq, committed, round_, guess.feature, h.level1, h.gamma1, want,
                                         [*draft.tokens, *guess.tokens]), events)
        return Ahead(h, guess.tokens[0], guess.q[0], after, events, guess.cost_with(after))


def _drain(events: Generator[Event, None, T], into: list[Event]) -> T:
    """Run a drafting generator to its end, its events appended to `into`; what it returns."""
    while True:
        try:
            into.append(next(events))
        except StopIteration as done:
            return done.value
