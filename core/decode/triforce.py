"""TriForce's rounds: level 1 drafts, level 2 (the target on its retrieval cache) verifies and drafts for level 3
(the target on its full cache), each verification exact speculative sampling. A policy chooses each round's
hierarchy: method triforce always the same, method auto whichever its cost model expects fastest (core.plan)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Generator, Iterator, Sequence, TypeVar

import torch

from core.decode.ahead import Ahead, Draft, Overlap
from core.decode.autoregressive import next_token
from core.decode.drafters import Drafter
from core.decode.graphs import Graphs, clock
from core.decode.request import RequestState
from core.decode.round import Forwards, Hierarchy, Policy, RoundRecord
from core.decode.sampling import distributions, draw
from core.events import DraftProposal, Event, Footprint, PlanChosen, RetrievalSelection, StepTiming, Verdict

T = TypeVar("T")

SHADOW_GAMMA = 4  # tokens a drafter is asked for in passing: within the γs auto mostly takes (docs/method-auto.md, 14)


class TriForce:
    """One generation, a schedule of one request (core.decode.request) with a single run's extras: rounds until its
    answer says stop. The request's full cache must hold prompt[:-1] and it must hold a level 2; `queries` are the
    ones its prefill recorded for the last prompt row (level 2's first selection); `drafters`: level 1's, by name;
    `policy` chooses each round's hierarchy and learns from its record."""

    def __init__(self, request: RequestState, queries: list[torch.Tensor], drafters: dict[str, Drafter],
                 policy: Policy, graphs: Graphs | None = None):
        self.request, self.queries, self.drafters, self.policy, self.graphs = request, queries, drafters, policy, graphs
        r = request
        self.target, self.prompt, self.cfg, self.generator, self.out = r.target, r.prompt, r.cfg, r.generator, r.out
        self.retrieval, self.level2, self.repetition, self.chains = r.retrieval, r.level2, r.repetition, r.chains
        self.counts, self.plans = r.counts, r.plans
        self.overlap = Overlap(r.target.model.device)
        self.pending: dict[str, tuple[list[int], int]] = {}  # shadow: a proposal in passing, and its tokens matched
        self.ahead_made = self.ahead_kept = 0  # next-round drafts level 2 made ahead, and those a round used

    def prepare(self) -> Iterator[Event]:
        """Before decoding: level 2's first selection, with the queries the prefill recorded for the last prompt
        row (part of filling the caches, as in the paper; a first use of new sizes may compile kernels)."""
        yield self.request.first_selection(self.queries)

    def run(self) -> Iterator[Event]:
        """The rounds: choose a hierarchy, draft, verify, accept, record."""
        seq, feature, shown, ready, round_ = self.request.seq, None, None, None, 0
        while not self.out.done:
            h = self.policy.choose()
            if h != shown and self.policy.reason:
                shown = h
                self.plans.append(h.name)
                yield PlanChosen(round=round_, plan=h.name, reason=self.policy.reason, level1=h.level1,
                                 level2=h.level2, gamma1=h.gamma1, gamma2=h.gamma2, ahead=h.ahead)
            record = RoundRecord(h)
            draft = yield from self.draft(h, seq, round_, feature, ready, record)
            accepted, token, feature, ready = self.verify(h, seq, draft, round_, record)
            emitted = draft.tokens[:accepted] + [token]
            yield Verdict(level=3, round=round_, proposed=draft.tokens, accepted=accepted, token=token,
                          bonus=accepted == len(draft.tokens))
            if self.policy.in_passing:
                record.in_passing = self.shadow(h, seq, emitted)
            # level 3's correction or bonus token; nothing drafted, it is the autoregressive step's own
            yield self.request.emit(emitted, draft.provenance[:accepted] + ["level3" if draft.tokens else "target"],
                                    round_)
            if record.reselect and not self.out.done:
                yield self.reselect(accepted, round_, len(seq) - 1, record)
            self.policy.observe(record)
            yield StepTiming(round=round_, level1_ms=record.level1_ms, level2_ms=record.level2_ms + record.sync_ms,
                             level3_ms=record.level3_wall_ms, selection_ms=record.selection_ms, tokens=accepted + 1,
                             level2_forwards=draft.level2_forwards)
            round_ += 1

    def draft(self, h: Hierarchy, seq: list[int], round_: int, feature: torch.Tensor | None, ready: Ahead | None,
              record: RoundRecord) -> Generator[Event, None, Draft]:
        """Level 2's cache brought in step where it drafts, then the round's draft: the one level 2 made ahead where
        it stands for this plan, else one drafted now (by level 2, by level 1 directly, or nothing), never longer
        than the answer still wants (the length depends on the emitted count alone, so verification stays exact)."""
        if h.level2:
            t0 = clock(self.graphs)
            self.request.sync_level2()
            record.sync_ms = (clock(self.graphs) - t0) * 1e3
        if ready is not None and ready.plan == h:
            self.ahead_kept += 1
            yield from ready.events
            draft = ready.draft  # its cost is in the record of the round that made it
        else:
            want = min(h.gamma2, self.cfg.max_new_tokens - len(self.out.ids))
            draft = (yield from self.draft_level2(seq, round_, feature, h.level1, h.gamma1, want)) if h.level2 \
                else (yield from self.draft_level1(h.level1, seq, round_, feature, want))
            record.took(draft)
        for _, proposed, accepted in draft.checks:
            self.counts.count(1, proposed, accepted)
        return draft

    def verify(self, h: Hierarchy, seq: list[int], draft: Draft, round_: int, record: RoundRecord
               ) -> tuple[int, int, torch.Tensor, Ahead | None]:
        """Level 3 checks the draft in one forward over the full cache (nothing drafted: the autoregressive step),
        level 2 drafting the next round beside it where the plan drafts ahead. Returns the drafts accepted, the next
        token, the hidden state that produced it, and the next round's draft where it stands."""
        cfg, target, committed, n = self.cfg, self.target, len(seq), len(draft.tokens)
        record.reselect = h.level2 and self.retrieval.policy.due(round_)
        # the next round's draft length should level 3 accept all of this one (then it emits n + 1 tokens)
        after = min(h.gamma2, cfg.max_new_tokens - len(self.out.ids) - n - 1)
        ahead = h.ahead and n > 0 and not record.reselect and after > 0
        t0, captured = clock(self.graphs), self.graphs.capture_s if self.graphs is not None else 0.0
        made = None
        if n or record.reselect:
            with self.overlap.level3() if ahead else contextlib.nullcontext():
                h3 = target.states(seq, n + 1, committed, draft.tokens, record=n + 1 if record.reselect else 0)
            if ahead:
                made = self.draft_ahead(h, seq, draft, round_ + 1, after)
                self.overlap.join(h3)
                pass_ms, after_pass = self.overlap.level3_ms(), clock(self.graphs)  # waits for the pass
            # level 2's guess joins the draft: it stands as often as level 3 accepts a draft
            accepted, token = self.request.level3_verdict(target.head(h3), draft.tokens, draft.q,
                                                          (made.guess, made.q) if made else None)
            feature = h3[accepted]
        else:  # nothing to verify: the step method ar takes (the same draw: verifying no drafts samples p)
            accepted, (token, h3, _) = 0, next_token(target, seq, self.repetition, cfg, self.generator)
            feature = h3[0]
        record.level3_wall_ms = record.level3_ms = (clock(self.graphs) - t0) * 1e3
        record.rows, record.drafted, record.accepted = n + 1, n, accepted
        self.counts.count(2 if h.level2 else 1, n, accepted)  # (level 1's drafts checked by level 3 directly)
        if h.level1 and not h.level2 and draft.asked:
            record.level1_checks.append((3, draft.asked, n, accepted))
        if made is None:
            return accepted, token, feature, None
        # Drafting ahead, level 3's own time is its pass and what followed it, unless a first capture (warm-up) fell
        # in the drafting beside it: then the round's time less that drafting.
        self.ahead_made += 1
        record.post_ms = (clock(self.graphs) - after_pass) * 1e3
        fresh = self.graphs is not None and self.graphs.capture_s != captured
        record.level3_ms = record.level3_wall_ms - (made.spent.level1_s + made.spent.level2_s) * 1e3 if fresh \
            else pass_ms + record.post_ms
        record.took(made.spent, beside=True)
        if accepted == n:  # the whole draft stood: then the guess (a rejected guess has no residual mass)
            record.guess = token == made.guess
        return accepted, token, feature, made if record.guess else None

    def reselect(self, accepted: int, round_: int, position: int, record: RoundRecord) -> RetrievalSelection:
        """Choose level 2's chunks again with the queries level 3 recorded at the last accepted row."""
        event = self.retrieval.select(self.target.queries, accepted, round_ + 1, position)
        record.selection_ms = event.seconds * 1e3
        return event

    def shadow(self, h: Hierarchy, seq: list[int], emitted: list[int]) -> dict[str, tuple[list, float]]:
        """Ask each drafter that needs no model (prompt lookup: microseconds a token), unless it drafted this round,
        what it would have drafted, as levels 1 → 3 at γ SHADOW_GAMMA would ask it: each proposal is checked against
        the tokens level 3 emits, this round and the next ones, up to a mismatch or its end, and the next one is
        asked for at the token after. Returns, by drafter, its checks (asked, proposed, matched) and the time taken:
        the policy learns its cost and acceptance without running it. Sampled too, a proposal x matches the emitted
        token with probability p(x), the probability that level 3 accepts x. Checked only within a round, the
        proposals of one-token (autoregressive) rounds would show their first tokens alone."""
        seen = {}
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
            seen[name] = (checks, (time.perf_counter() - t0) * 1e3)
        return seen

    def footprint(self) -> Footprint:
        """Acceptance at both levels, the default drafter and its forwards, the retrieval and level-1 caches' bytes,
        the policy's choices."""
        name = next(iter(self.drafters), "none")
        return self.request.footprint(self.drafters.get(name), name, ahead_made=self.ahead_made,
                                      ahead_kept=self.ahead_kept)

    def draft_level1(self, level1: str, seq: list[int], round_: int, feature: torch.Tensor | None, want: int
                     ) -> Generator[Event, None, Draft]:
        """Level 1's tokens for level 3 directly (classic two-model speculative decoding); nothing without a
        drafter (autoregressive)."""
        draft = Draft()
        if not level1 or not want:
            return draft
        t0 = clock(self.graphs)
        proposal = self.drafters[level1].propose(seq, want, len(seq), (), feature)
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

    def draft_level2(self, seq: list[int], round_: int, feature: torch.Tensor | None, level1: str, gamma1: int,
                     want: int, prefix: Sequence[int] = ()) -> Generator[Event, None, Draft]:
        """Level 2 produces `want` tokens after seq + `prefix`, verifying up to `gamma1` proposals of drafter `level1`
        ("": none) per forward; yields events, returns the draft. `feature`: the hidden state that produced the last
        token, for a drafter that uses it."""
        if not level1 and self.chains:
            return (yield from self.draft_alone(seq, round_, want, prefix))[1]
        level2, committed = self.level2, len(seq)
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
            accepted, token, p2 = self.request.level2_check(level2.head(h2), before, proposals, q1)
            draft.level1_s += t1 - t0
            draft.forwards.append(Forwards(1, len(proposals) + 1, (clock(self.graphs) - t1) * 1e3))
            draft.asked += asked
            if asked:
                draft.checks.append((asked, len(proposals), accepted))
            if proposals:
                yield DraftProposal(round_, proposals, copied)
            yield Verdict(level=2, round=round_, proposed=proposals, accepted=accepted, token=token,
                          bonus=accepted == len(proposals))
            draft.tokens += proposals[:accepted] + [token]
            draft.feature = h2[accepted]
            draft.q += list(p2[:accepted + 1])
            draft.provenance += ["copy" if c else "draft" for c in copied[:accepted]] + ["level2"]
        del draft.tokens[want:], draft.q[want:], draft.provenance[want:]
        return draft

    def draft_alone(self, seq: list[int], round_: int, want: int, prefix: Sequence[int] = (), guess: bool = False
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
        hidden = level2.states(seq, 1, len(seq), prefix)
        ids, q = [], []
        for i in range(want + guess):
            if i:
                hidden = level2.follow(ids[-1])
            q.append(distributions(level2.head(hidden), cfg)[0])
            ids.append(draw(q[-1], self.generator))
        tokens = torch.cat(ids).tolist()  # the one wait
        level2.settle(tokens[:-1])
        first = (tokens.pop(0), q.pop(0)) if guess else None
        forwards = Forwards(want + guess, 1, (clock(self.graphs) - t0) * 1e3, chained=True)
        draft = Draft(tokens, q, ["level2"] * want, forwards=[forwards], feature=hidden[0])
        for token in tokens:
            yield Verdict(level=2, round=round_, proposed=[], accepted=0, token=token, bonus=True)
        return first, draft

    def draft_ahead(self, h: Hierarchy, seq: list[int], draft: Draft, round_: int, want: int) -> Ahead:
        """While level 3 verifies `draft`: level 2's guess at the token level 3 emits after it, should it accept it
        all, and the next round's draft of `want` tokens after that guess. Exact like any draft: a round uses it
        only when seq grew by exactly draft + guess, and it is then what level 2 drafts after that sequence."""
        # The guess is level 2's next token, drawn as any it drafts, and level 3 checks it like one more draft: it
        # stands with probability sum min(p3, q2), about level 2's acceptance (0.9 and more). Waiting for level 3 to
        # draw the same token instead, even the likeliest would stand only with probability p3(likeliest) (0.71-0.86
        # on the real pair, sampled).
        events: list[Event] = []
        if not h.level1 and self.chains:  # the guess leads the chain
            (token, q), after = _drain(self.draft_alone(seq, round_, want, draft.tokens, guess=True), events)
            return Ahead(h, token, q, after, events, replace(after, tokens=[], q=[], provenance=[]))
        guess = _drain(self.draft_level2(seq, round_, None, "", 0, 1, draft.tokens), [])  # its verdict unshown
        after = _drain(self.draft_level2(seq, round_, guess.feature, h.level1, h.gamma1, want,
                                         [*draft.tokens, *guess.tokens]), events)
        spent = Draft(level1_s=after.level1_s, asked=after.asked, forwards=guess.forwards + after.forwards,
                      checks=after.checks)
        return Ahead(h, guess.tokens[0], guess.q[0], after, events, spent)


def _drain(events: Generator[Event, None, T], into: list[Event]) -> T:
    """Run a drafting generator to its end, its events appended to `into`; what it returns."""
    while True:
        try:
            into.append(next(events))
        except StopIteration as done:
            return done.value
