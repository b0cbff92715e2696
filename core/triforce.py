"""The hierarchical loop: level 1 drafts, level 2 (target + retrieval cache) verifies and drafts for level 3
(target + full cache), each verification exact speculative sampling."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generator, Iterator

import torch

from core.config import GenerationConfig
from core.cuda_graphs import Graphs
from core.drafters import Drafter
from core.events import Acceptance, DraftProposal, Event, Footprint, Provenance, StepTiming, Verdict
from core.kvcache import KVCache
from core.levels import Level
from core.output import Output
from core.repetition import Repetition
from core.retrieval import Retrieval
from core.sampling import distributions, residual_distribution, speculative_verify


@dataclass
class Draft:
    """What level 2 hands level 3 in one round: its tokens, their distributions q and provenance, and the time
    levels 1 and 2 took."""

    tokens: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    provenance: list[Provenance] = field(default_factory=list)
    level1_s: float = 0.0
    level2_s: float = 0.0


class TriForce:
    """One generation: rounds of level-3 verification until `out` says stop. The target level's full cache must
    hold prompt[:-1]; `queries` are the ones its prefill recorded for the last prompt row (the first selection);
    `retrieval_cache`: where level 2's cache goes (core.memory sizes it); `index_device`: where the chunk index is
    kept (default: the model's device)."""

    def __init__(self, target: Level, prompt: list[int], queries: list[torch.Tensor], drafter: Drafter,
                 cfg: GenerationConfig, generator: torch.Generator, out: Output, retrieval_cache: KVCache,
                 graphs: Graphs | None = None, index_device: torch.device | None = None):
        self.target, self.prompt, self.queries, self.drafter = target, prompt, queries, drafter
        self.cfg, self.generator, self.out = cfg, generator, out
        model = target.model
        self.retrieval = Retrieval(target.cache, cfg, retrieval_cache, model.ops, index_device)
        self.level2 = Level(model, self.retrieval.cache, prompt[:-1], graphs)
        self.repetition = Repetition(cfg, model.args.vocab_size, model.device, len(prompt))  # levels 2 and 3 alike
        self.counts = Acceptance()

    def run(self) -> Iterator[Event]:
        """The rounds' events: proposals, verdicts, tokens, selections, timings."""
        cfg, target, retrieval = self.cfg, self.target, self.retrieval
        yield retrieval.select(self.queries, -1, 0, target.cache.seq_len)
        seq = list(self.prompt)
        round_ = 0
        feature = None  # the target's hidden state that produced seq's last token (none for the prompt's)
        while not self.out.done:
            committed = len(seq)
            draft = yield from self.draft_level2(seq, committed, round_, feature)
            t0 = time.perf_counter()
            reselect = retrieval.policy.due(round_)
            n = len(draft.tokens)
            h3 = target.states(seq, n + 1, committed, draft.tokens, record=n + 1 if reselect else 0)
            p3 = distributions(self.repetition(target.model.head(h3), seq, draft.tokens), cfg)
            accepted, token = speculative_verify(draft.tokens, torch.stack(draft.q), p3, self.generator)
            feature = h3[accepted]
            level3_s = time.perf_counter() - t0
            self.counts.level2_proposed += n
            self.counts.level2_accepted += accepted
            yield Verdict(3, round_, draft.tokens, accepted, token, accepted == n)
            seq += draft.tokens[:accepted] + [token]
            yield self.out.add(draft.tokens[:accepted] + [token], draft.provenance[:accepted] + ["level3"], round_)
            t0 = time.perf_counter()
            retrieval.sync(self.level2, target, seq, committed)
            selection_s = 0.0
            if reselect and not self.out.done:
                event = retrieval.select(target.queries, accepted, round_ + 1, committed + accepted)
                selection_s = event.seconds
                yield event
            sync_s = time.perf_counter() - t0 - selection_s
            yield StepTiming(round_, draft.level1_s * 1e3, draft.level2_s * 1e3, (level3_s + sync_s) * 1e3,
                             selection_s * 1e3, accepted + 1)
            round_ += 1

    def footprint(self) -> Footprint:
        """Acceptance at both levels, the drafter and its forwards, the retrieval and level-1 caches' bytes."""
        level1 = self.drafter.level
        return Footprint(self.counts, self.drafter.name, self.drafter.steps, self.retrieval.cache.nbytes,
                         level1.cache.nbytes if level1 else 0, level1.model.step_weight_bytes() if level1 else 0)

    def draft_level2(self, seq: list[int], committed: int, round_: int, feature: torch.Tensor | None
                     ) -> Generator[Event, None, Draft]:
        """Level 2 produces up to gamma2 tokens, and no more than the answer still wants, verifying level-1
        proposals; yields events, returns the draft. `feature`: the hidden state that produced seq's last token, for a
        drafter that uses it. (The length depends on the emitted count alone, so verification stays exact.)"""
        cfg, level2 = self.cfg, self.level2
        want = min(cfg.gamma2, cfg.max_new_tokens - len(self.out.ids))
        draft = Draft()
        while len(draft.tokens) < want:
            t0 = time.perf_counter()
            proposals, q1, copied = self.drafter.propose(seq, min(cfg.gamma1, want - len(draft.tokens)), committed,
                                                         draft.tokens, feature)
            t1 = time.perf_counter()
            h2 = level2.states(seq, len(proposals) + 1, committed, draft.tokens + proposals)
            p2 = distributions(self.repetition(level2.model.head(h2), seq, draft.tokens + proposals), cfg)
            # The residual is explicit here: the reference code samples from p2 instead, which biases level 3's q.
            accepted, token = speculative_verify(proposals, q1, p2, self.generator, residual=residual_distribution)
            draft.level1_s += t1 - t0
            draft.level2_s += time.perf_counter() - t1
            self.counts.level1_proposed += len(proposals)
            self.counts.level1_accepted += accepted
            if proposals:
                yield DraftProposal(round_, proposals, copied)
            yield Verdict(2, round_, proposals, accepted, token, accepted == len(proposals))
            draft.tokens += proposals[:accepted] + [token]
            feature = h2[accepted]
            draft.q += list(p2[:accepted + 1])
            draft.provenance += ["copy" if c else "draft" for c in copied[:accepted]] + ["level2"]
        del draft.tokens[want:], draft.q[want:], draft.provenance[want:]
        return draft
