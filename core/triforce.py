"""The hierarchical loop: level 1 drafts, level 2 (target + retrieval cache) verifies and drafts for level 3
(target + full cache), each verification exact speculative sampling."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from core.config import GenerationConfig
from core.drafters import Drafter
from core.events import Acceptance, DraftProposal, Event, Provenance, RetrievalSelection, StepTiming, Verdict
from core.kvcache import CachePool, KVCache
from core.levels import Level, common_prefix
from core.output import Output
from core.retrieval import ChunkIndex, chunks_to_keep, gather_selection, retrieval_cache, select_chunks
from core.sampling import distributions, residual_distribution, speculative_verify


@dataclass
class Tally(Acceptance):
    """Counters of one TriForce run."""

    level2_forwards: int = 0
    retrieval_bytes: int = 0


class Retrieval:
    """Level 2's cache: the selected prompt chunks plus every later token, re-selected by policy."""

    def __init__(self, full: KVCache, cfg: GenerationConfig, pool: CachePool | None = None):
        self.full, self.cfg = full, cfg
        self.index = ChunkIndex.build(full, full.seq_len, cfg.chunk_size)
        self.n_select = chunks_to_keep(self.index, cfg.budget)
        self.cache = retrieval_cache(full, self.index, cfg.budget, cfg.max_new_tokens + cfg.gamma1 + cfg.gamma2 + 2,
                                     pool)
        self.synced = full.seq_len  # positions below this hold the full cache's keys/values

    def due(self, round_: int) -> bool:
        """Whether to re-select after level-3 round `round_` (counting from 0)."""
        r = self.cfg.reselect
        return r == "every_verify" or (isinstance(r, int) and (round_ + 1) % r == 0)

    def select(self, row: int, round_: int, position: int) -> RetrievalSelection:
        """Pick chunks with the full cache's recorded queries at `row` and gather them."""
        t0 = time.perf_counter()
        queries = torch.stack([q[:, row] for q in self.full.queries])
        ids = select_chunks(self.index, queries, self.n_select)
        gather_selection(self.full, self.index, ids, self.cache)
        return RetrievalSelection(round_, position, self.cfg.chunk_size, self.index.num_chunks, self.index.length,
                                  self.cfg.budget, ids.tolist(), time.perf_counter() - t0, self.cache.nbytes)

    def sync(self, level2: Level, target: Level, seq: list[int], committed: int) -> None:
        """Drop level 2's rejected tokens and give its kept ones the full cache's keys/values."""
        valid = common_prefix(target.tokens, seq, committed, len(seq))
        keep = common_prefix(level2.tokens, seq, self.synced, valid)
        level2.cache.truncate(keep)
        del level2.tokens[keep:]
        if keep > self.synced:
            self.cache.copy_positions(self.full, self.synced, keep)
            self.synced = keep


def draft_level2(drafter: Drafter, level2: Level, seq: list[int], committed: int, cfg: GenerationConfig,
                 generator: torch.Generator, tally: Tally, round_: int, timing: dict, feature: torch.Tensor | None
                 ) -> Iterator[Event | tuple[list[int], list[torch.Tensor], list[Provenance]]]:
    """Level 2 produces up to gamma2 tokens, verifying level-1 proposals; yields events, then its result.
    `feature`: the hidden state that produced seq's last token, for a drafter that uses it."""
    tokens: list[int] = []
    qs: list[torch.Tensor] = []
    provenance: list[Provenance] = []
    while len(tokens) < cfg.gamma2:
        t0 = time.perf_counter()
        proposals, q1, copied = drafter.propose(seq, min(cfg.gamma1, cfg.gamma2 - len(tokens)), committed, tokens,
                                                feature)
        t1 = time.perf_counter()
        h2 = level2.states(seq, len(proposals) + 1, committed, tokens + proposals)
        p2 = distributions(level2.model.head(h2), cfg)
        # The residual is explicit here: the reference code samples from p2 instead, which biases level 3's q.
        accepted, token = speculative_verify(proposals, q1, p2, generator, residual=residual_distribution)
        timing["level1"] += t1 - t0
        timing["level2"] += time.perf_counter() - t1
        tally.level2_forwards += 1
        tally.level1_proposed += len(proposals)
        tally.level1_accepted += accepted
        if proposals:
            yield DraftProposal(round_, proposals, copied)
        yield Verdict(2, round_, proposals, accepted, token, accepted == len(proposals))
        tokens += proposals[:accepted] + [token]
        feature = h2[accepted]
        qs += list(p2[:accepted + 1])
        provenance += ["copy" if c else "draft" for c in copied[:accepted]] + ["level2"]
    yield tokens[:cfg.gamma2], qs[:cfg.gamma2], provenance[:cfg.gamma2]


def triforce(target: Level, prompt: list[int], drafter: Drafter, cfg: GenerationConfig,
             generator: torch.Generator, out: Output, tally: Tally, pool: CachePool | None = None) -> Iterator[Event]:
    """Rounds of level-3 verification until `out` says stop. The full cache must hold prompt[:-1] and have
    recorded the last prefill row's queries. `pool`: where the retrieval cache may come from."""
    full = target.cache
    retrieval = Retrieval(full, cfg, pool)
    tally.retrieval_bytes = retrieval.cache.nbytes
    yield retrieval.select(-1, 0, full.seq_len)
    level2 = Level(target.model, retrieval.cache, prompt[:-1])
    seq = list(prompt)
    round_ = 0
    feature = None  # the target's hidden state that produced seq's last token (none for the prompt's)
    while not out.done:
        timing = {"level1": 0.0, "level2": 0.0}
        committed = len(seq)
        for item in draft_level2(drafter, level2, seq, committed, cfg, generator, tally, round_, timing, feature):
            if isinstance(item, Event):
                yield item
            else:
                draft, q2, provenance = item
        t0 = time.perf_counter()
        reselect = retrieval.due(round_)
        full.record_rows = len(draft) + 1 if reselect else 0
        h3 = target.states(seq, len(draft) + 1, committed, draft)
        p3 = distributions(target.model.head(h3), cfg)
        accepted, token = speculative_verify(draft, torch.stack(q2), p3, generator)
        feature = h3[accepted]
        level3_s = time.perf_counter() - t0
        tally.level2_proposed += len(draft)
        tally.level2_accepted += accepted
        yield Verdict(3, round_, draft, accepted, token, accepted == len(draft))
        seq += draft[:accepted] + [token]
        yield out.add(draft[:accepted] + [token], provenance[:accepted] + ["level3"], round_)
        t0 = time.perf_counter()
        retrieval.sync(level2, target, seq, committed)
        selection_s = 0.0
        if reselect and not out.done:
            event = retrieval.select(accepted, round_ + 1, committed + accepted)
            selection_s = event.seconds
            yield event
        sync_s = time.perf_counter() - t0 - selection_s
        yield StepTiming(round_, timing["level1"] * 1e3, timing["level2"] * 1e3, (level3_s + sync_s) * 1e3,
                         selection_s * 1e3, accepted + 1)
        round_ += 1
