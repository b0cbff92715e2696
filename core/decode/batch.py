"""Several requests decoded together, each exactly as it would be alone.

A round serves every request in the batch at once: level 2 drafts for the requests that draft, one forward per token
for all of them (each drawn token fed straight back on the device), then level 3 verifies every request's draft in
one forward (an autoregressive request feeds one row). A forward's rows are the requests' new tokens side by side
(core.cache.ragged.Ragged): the projections read the weights once for all of them, each request's rows attend over
its own caches, and every row is computed as a one-row step of that request alone (the decode kernels' property),
so a greedy request emits what it emits alone. Verification, residuals and bonus tokens are each request's own,
drawn from its own generator. Requests join and leave between rounds (`join`, `leave`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.cache.ragged import Ragged
from core.config import DECODE_TOKENS
from core.decode.drafters import Drafter, Proposal
from core.decode.graphs import Graphs, RaggedGraphs, clock
from core.decode.levels import Level
from core.decode.request import RequestState
from core.decode.round import Ask, BatchPolicy, BatchRecord, Hierarchy
from core.decode.sampling import distributions, draw
from core.events import DraftProposal, Event, PlanChosen, StepTiming, Verdict
from core.model.transformer import Transformer


@dataclass
class Slot:
    """One request of a batch (its state: core.decode.request), with what the batch keeps of it between and within
    rounds: its level-1 drafter (method triforce with one: it proposes, level 2 checks), whether its level 2 may draft
    for a planner (its retrieval cache leaves part of the prompt out), this round's draft, its rounds, the most other
    requests it was decoded beside, and the events it has not yet handed out."""

    key: str
    request: RequestState
    drafter: Drafter | None = None
    level2_cuts: bool = True
    gamma: int = 0  # this round's draft length (0: an autoregressive step)
    draft: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # level 2's distribution behind each drafted token
    emitted: list[int] = field(default_factory=list)  # this round's accepted drafts and level 3's token
    provenance: list[str] = field(default_factory=list)  # who drafted each token of the draft
    level1_ms: float = 0.0  # its level 1's proposing this round
    feature: torch.Tensor | None = None  # the target's hidden state that produced the last token (level 1 fuses it)
    rounds: int = 0
    beside: int = 0  # the most other requests decoded in a round with it
    plan: int | None = None  # the γ2 its events last announced
    events: list[Event] = field(default_factory=list)

    @property
    def ask(self) -> Ask:
        """What the batch's policy knows of it."""
        r = self.request
        return Ask(r.cfg.kind.planned, (r.cfg.gamma2 if r.drafts else 0), r.drafts and self.level2_cuts,
                   r.counts.level2_verified, r.counts.level2_accepted, len(r.seq), r.cfg.budget or 0,
                   r.cfg.is_greedy)


class Batch:
    """The requests decoding together on one target model; `round` runs one round for all of them. `policy`: chooses
    each request's γ2 (method auto's for a batch: core.plan.policy.BatchAuto); `graphs`: the engine's (None: steps
    launched eagerly)."""

    def __init__(self, model: Transformer, policy: BatchPolicy, graphs: Graphs | None = None):
        self.model, self.policy = model, policy
        self.graphs = graphs
        self.ragged = RaggedGraphs(graphs) if graphs is not None else None
        self.slots: list[Slot] = []

    def join(self, slot: Slot) -> None:
        """A prefilled request joins at the next round (its level 2 selects its first chunks now)."""
        r = slot.request
        if r.retrieval is not None:
            slot.events.append(r.first_selection(r.target.queries))
        self.slots.append(slot)

    def leave(self, slot: Slot) -> None:
        """A request leaves (finished or stopped); the graphs on its caches go."""
        self.slots.remove(slot)
        if self.ragged is not None:
            for level in (slot.request.target, slot.request.level2):
                if level is not None:
                    self.ragged.forget(level.cache)

    def forward(self, feeds: list[tuple[Level, int]], ids: torch.Tensor, record: int = 0, drafting: bool = False
                ) -> torch.Tensor:
        """One forward over several levels of the model (each fed its count of `ids`, in order): the normed hidden
        states of every row [rows, D]; with `record`, each level's `queries` hold its rows' recorded queries."""
        ragged = Ragged([(level.cache, n) for level, n in feeds])
        ops = self.model.ops.drafting() if drafting else self.model.ops
        if self.ragged is not None and ragged.on_cuda and ops.device_steps and \
                all(n <= DECODE_TOKENS for _, n in feeds) and self.model.rotary.rope_type != "dynamic":
            hidden, queries = self.ragged.step(self.model, ragged, ids, record, ops)
        else:
            ragged.begin()
            hidden, queries = self.model.step(ids.to(self.model.device), ragged, None, record, ops=ops)
        if record:
            a = 0
            for level, n in feeds:
                level.queries = [q[:, a:a + n] for q in queries]
                a += n
        return hidden

    def round(self) -> list[Slot]:
        """One round for every request in the batch; each slot's events are appended to its `events`. Returns the
        slots whose answers are done (still in the batch: the caller lets them `leave`)."""
        slots = [s for s in self.slots if not s.request.out.done]
        if not slots:
            return []
        self.plan(slots)
        for s in slots:
            s.draft, s.q, s.provenance, s.level1_ms = [], [], [], 0.0
        alone = [s for s in slots if s.gamma and s.drafter is None]
        t0 = clock(self.graphs)
        steps = self.draft(alone)
        t1 = clock(self.graphs)
        self.draft_level1([s for s in slots if s.gamma and s.drafter is not None])
        t2 = clock(self.graphs)
        rows, verdicts = self.verify(slots)
        t3 = clock(self.graphs)
        self.policy.observe(BatchRecord(rows, (t3 - t2) * 1e3, len(alone), steps, (t1 - t0) * 1e3, verdicts))
        level1_ms = sum(s.level1_ms for s in slots)  # each request's level 1 proposes in turn
        for s in slots:
            s.beside = max(s.beside, len(slots) - 1)
            s.events.append(StepTiming(round=s.rounds, level1_ms=s.level1_ms, level2_ms=(t2 - t0) * 1e3 - level1_ms,
                                       level3_ms=(t3 - t2) * 1e3, selection_ms=0.0, tokens=len(s.emitted),
                                       level2_forwards=steps if s.gamma else 0))
            s.rounds += 1
        return [s for s in slots if s.request.out.done]

    def plan(self, slots: list[Slot]) -> None:
        """Each request's draft length this round, as the policy chooses (an autoregressive request none, a triforce
        request its own γ2, the planned ones the planner's), never longer than its answer still wants (a length set
        by the emitted count: exact)."""
        gammas = self.policy.choose([s.ask for s in slots])
        for s, gamma in zip(slots, gammas):
            r = s.request
            s.gamma = min(gamma, r.wanted)
            if r.cfg.kind.planned and r.drafts and s.plan != gamma:
                s.plan = gamma
                name = Hierarchy("", True, 0, gamma).name
                r.plans.append(name)
                s.events.append(PlanChosen(round=s.rounds, plan=name, reason=self.policy.reason, level1="",
                                           level2=bool(gamma), gamma1=0, gamma2=gamma, ahead=False))

    def draft(self, slots: list[Slot]) -> int:
        """Level 2 drafts each slot's γ2 tokens by itself, every step one forward for the slots still drafting, each
        drawn token fed straight back on the device (the host waits once, at the end, unless a request's repetition
        control must see each id: core.decode.request.chains). Returns the steps taken."""
        for s in slots:
            s.request.sync_level2()
        if not slots:
            return 0
        news = [s.request.level2.pending(s.request.seq, 1, len(s.request.seq)) for s in slots]
        hidden = self.forward([(s.request.level2, len(n)) for s, n in zip(slots, news)],
                              torch.tensor([t for n in news for t in n]), drafting=True)
        for s, n in zip(slots, news):
            s.request.level2.fed(n)
        rows = torch.tensor(_last_rows([len(n) for n in news]), device=hidden.device)
        hidden, active, drawn, steps = hidden[rows], slots, {id(s): [] for s in slots}, 1
        for j in range(max(s.gamma for s in slots)):
            if j:  # the slots still drafting are fed the token each drew last
                active = [s for s in active if s.gamma > j]
                for s in active:
                    s.request.level2.tokens.append(-1)  # its id is known once read back (settle)
                hidden = self.forward([(s.request.level2, 1) for s in active],
                                      torch.cat([drawn[id(s)][-1] for s in active]), drafting=True)
                steps += 1
                for s in active:
                    s.request.level2.forwards += 1
            logits = self.model.head(hidden, self.model.ops.drafting())
            for s, row in zip(active, logits):
                r = s.request
                if not r.chains:  # level 2 drafts as level 3 will judge (the drafted ids read back: a wait)
                    row = r.repetition(row[None], r.seq, [int(t) for t in drawn[id(s)]])[0]
                s.q.append(distributions(row[None], r.cfg)[0])
                drawn[id(s)].append(draw(s.q[-1], r.generator))
        tokens = torch.cat([t for s in slots for t in drawn[id(s)]]).tolist()  # the one wait
        a = 0
        for s in slots:
            s.draft = tokens[a:a + s.gamma]
            a += s.gamma
            s.provenance = ["level2"] * s.gamma
            if s.gamma > 1:
                s.request.level2.settle(s.draft[:-1])
            for token in s.draft:
                s.events.append(Verdict(level=2, round=s.rounds, proposed=[], accepted=0, token=token, bonus=True))
        return steps

    def draft_level1(self, slots: list[Slot]) -> int:
        """Levels 1 → 2 for the slots whose level 1 drafts (TriForce.draft_level2, per request): each check, every
        slot's level 1 proposes up to its γ1 tokens, then one level-2 forward verifies every slot's proposals, each
        exactly against its own distribution, until every slot holds its γ2 tokens. Returns the level-2 forwards."""
        for s in slots:
            s.request.sync_level2()
        active, steps = list(slots), 0
        while active:
            proposals, news = [], []
            for s in active:
                r = s.request
                asked = min(r.cfg.gamma1, s.gamma - len(s.draft))
                t0 = clock(self.graphs)
                proposal = s.drafter.propose(r.seq, asked, len(r.seq), s.draft, s.feature) if asked else \
                    Proposal([], None, [])
                s.level1_ms += (clock(self.graphs) - t0) * 1e3
                proposals.append((asked, proposal))
                news.append(r.level2.pending(r.seq, len(proposal.tokens) + 1, len(r.seq), s.draft + proposal.tokens))
            hidden = self.forward([(s.request.level2, len(n)) for s, n in zip(active, news)],
                                  torch.tensor([t for n in news for t in n]), drafting=True)
            steps += 1
            logits, a = self.model.head(hidden, self.model.ops.drafting()), 0
            for s, new, (asked, proposal) in zip(active, news, proposals):
                r = s.request
                r.level2.fed(new)
                a += len(new)
                first = a - len(proposal.tokens) - 1
                accepted, token, p = r.level2_check(logits[first:a], s.draft, proposal.tokens, proposal.q)
                if asked:
                    r.counts.count(1, len(proposal.tokens), accepted)
                if proposal.tokens:
                    s.events.append(DraftProposal(s.rounds, proposal.tokens, proposal.copied))
                s.events.append(Verdict(level=2, round=s.rounds, proposed=proposal.tokens, accepted=accepted,
                                        token=token, bonus=accepted == len(proposal.tokens)))
                s.draft += proposal.tokens[:accepted] + [token]
                s.q += list(p[:accepted + 1])
                s.provenance += ["copy" if c else "draft" for c in proposal.copied[:accepted]] + ["level2"]
                s.feature = hidden[first + accepted]
            active = [s for s in active if len(s.draft) < s.gamma]
        for s in slots:  # the last check may overshoot γ2: its extra tokens go
            del s.draft[s.gamma:], s.q[s.gamma:], s.provenance[s.gamma:]
        return steps

    def verify(self, slots: list[Slot]) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Level 3 checks every slot's draft in one forward (an autoregressive slot: its next token); each slot's
        verdict, tokens and reselection. Returns the rows fed and level 3's verdict on each drafting request's draft
        (drafted, accepted)."""
        reselect = [s.request.retrieval is not None and s.gamma and s.request.retrieval.policy.due(s.rounds)
                    for s in slots]
        news = [s.request.target.pending(s.request.seq, len(s.draft) + 1, len(s.request.seq), s.draft)
                for s in slots]
        counts = [len(n) for n in news]
        hidden = self.forward([(s.request.target, n) for s, n in zip(slots, counts)],
                              torch.tensor([t for n in news for t in n]), record=sum(counts) if any(reselect) else 0)
        for s, n in zip(slots, news):
            s.request.target.fed(n)
        logits = self.model.head(hidden)
        a, verdicts = 0, []
        for s, n, again in zip(slots, counts, reselect):
            r = s.request
            first, a = a + n - len(s.draft) - 1, a + n  # its rows: the draft's and the one before it
            accepted, token = r.level3_verdict(logits[first:a], s.draft, s.q)
            if r.drafts:  # every round of a drafting method has level 3's verdict, one that drafted nothing too
                r.counts.count(2, len(s.draft), accepted)
                if s.draft and s.level2_cuts:  # (level 2 on the whole prompt says nothing of retrieval)
                    verdicts.append((len(s.draft), accepted))
                s.events.append(Verdict(level=3, round=s.rounds, proposed=s.draft, accepted=accepted, token=token,
                                        bonus=accepted == len(s.draft)))
            s.emitted = s.draft[:accepted] + [token]
            s.events.append(r.emit(s.emitted, s.provenance[:accepted] + ["level3" if s.draft else "target"],
                                   s.rounds))
            s.feature = hidden[first + accepted]
            if again and not r.out.done:
                s.events.append(r.retrieval.select(r.target.queries, n - len(s.draft) - 1 + accepted, s.rounds + 1,
                                                   len(r.seq) - 1))
        return sum(counts), tuple(verdicts)


def _last_rows(counts: list[int]) -> list[int]:
    """The index of each part's last row among rows laid out part after part."""
    out, a = [], 0
    for n in counts:
        a += n
        out.append(a - 1)
    return out
