"""One request through TriForce's rounds, whatever schedules it: what it carries (its prompt and answer, its
sampling, repetition control and counts, its level 3 on the full cache and level 2 on its retrieval cache) and the
steps every schedule takes for it — level 2 kept in step with level 3, level 2's check of level 1's proposals, level
3's verdict on a draft, the emitted tokens. A single run (core.decode.triforce) is a schedule of one request with
its extras (drafting ahead, drafters asked in passing, offloading); a batch (core.decode.batch) a schedule of many.
Both judge every draft by the functions below, so a request's answer is the same under either."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.cache.kvcache import KVCache
from core.cache.retrieval import Retrieval
from core.config import GenerationConfig
from core.decode.drafters import Drafter
from core.decode.graphs import Graphs
from core.decode.levels import Level, common_prefix
from core.decode.output import Output
from core.decode.repetition import Repetition
from core.decode.sampling import distributions, residual_distribution, speculative_verify
from core.events import Acceptance, Event, Footprint, RetrievalSelection
from core.model import parallel


def chains(cfg: GenerationConfig) -> bool:
    """Whether level 2 drafting alone feeds each drawn token straight into its next forward on the device, the host
    waiting once per draft. Not where repetition control must see each drafted id on the host (the ids are then read
    back token by token, in a single run and in a batch alike), nor where tensor-parallel ranks must agree on each
    draw."""
    return not Repetition.applies(cfg) and parallel.ACTIVE is None


@dataclass
class RequestState:
    """What one request carries through the rounds. `level2` and `retrieval` are None for a request that never
    drafts with level 2 (method ar)."""

    prompt: list[int]
    cfg: GenerationConfig
    target: Level
    out: Output
    generator: torch.Generator
    retrieval: Retrieval | None = None
    level2: Level | None = None
    counts: Acceptance = field(default_factory=Acceptance)
    plans: list[str] = field(default_factory=list)  # the hierarchies its rounds ran, as named when chosen
    seq: list[int] = field(init=False)
    repetition: Repetition = field(init=False)
    chains: bool = field(init=False)

    def __post_init__(self):
        model = self.target.model
        self.seq = list(self.prompt)
        self.repetition = Repetition(self.cfg, model.args.vocab_size, model.device, len(self.prompt))  # 2 and 3 alike
        self.chains = chains(self.cfg)

    @classmethod
    def start(cls, target: Level, prompt: list[int], cfg: GenerationConfig, generator: torch.Generator, out: Output,
              retrieval_cache: KVCache | None = None, graphs: Graphs | None = None,
              index_device: torch.device | None = None) -> RequestState:
        """A prefilled request (its target level's full cache holds prompt[:-1]); with `retrieval_cache` (from
        core.cache.memory), level 2 on it."""
        r = cls(prompt, cfg, target, out, generator)
        if retrieval_cache is not None:
            model = target.model
            r.retrieval = Retrieval(target.cache, cfg, retrieval_cache, model.ops, index_device)
            r.level2 = Level(model, r.retrieval.cache, prompt[:-1], graphs, drafting=True)
        return r

    @property
    def drafts(self) -> bool:
        """Whether level 2 may draft for it (method triforce or auto)."""
        return self.level2 is not None

    @property
    def wanted(self) -> int:
        """Tokens its answer may still take."""
        return self.cfg.max_new_tokens - len(self.out.ids)

    def first_selection(self, queries: list[torch.Tensor]) -> RetrievalSelection:
        """Level 2's first chunks, chosen with the queries the prefill recorded for the last prompt row."""
        return self.retrieval.select(queries, -1, 0, self.target.cache.seq_len)

    def sync_level2(self) -> None:
        """Drop level 2's rejected tokens and give it every token the full cache holds since they last agreed: the
        keys and values of the tokens level 2 drafted, and of the rounds it sat out, come from the full cache."""
        target, level2, retrieval, seq = self.target, self.level2, self.retrieval, self.seq
        valid = common_prefix(target.tokens, seq, retrieval.synced, len(seq))
        keep = common_prefix(level2.tokens, seq, retrieval.synced, valid)
        level2.cache.truncate(keep)
        del level2.tokens[keep:]
        if valid > retrieval.synced:
            level2.tokens.extend(seq[keep:valid])
            retrieval.copy_from_full(valid)

    def level2_check(self, logits: torch.Tensor, before: list[int], proposed: list[int], q1: torch.Tensor | None
                     ) -> tuple[int, int, torch.Tensor]:
        """Level 2 checks level 1's `proposed` tokens (drawn from q1; None: deterministic) after seq + `before`, from
        its logits over those rows and the one before them: (accepted, next token, level 2's distributions). A
        rejection draws from the residual max(p2 - q1, 0), so what level 2 emits follows p2 exactly — level 3's q
        (the reference code samples from p2 instead, which biases level 3's proposal)."""
        p = distributions(self.repetition(logits, self.seq, [*before, *proposed]), self.cfg)
        accepted, token = speculative_verify(proposed, q1, p, self.generator, residual=residual_distribution)
        return accepted, token, p

    def level3_verdict(self, logits: torch.Tensor, draft: list[int], q: list[torch.Tensor],
                       guess: tuple[int, torch.Tensor] | None = None) -> tuple[int, int]:
        """Level 3 judges `draft` (drawn from the distributions `q`) from its logits over the draft's rows and the one
        before them: (accepted, the correction or bonus token). A `guess` (a token and its q) drafted ahead joins the
        draft, checked against the row after it, which would otherwise give the bonus token."""
        p = distributions(self.repetition(logits, self.seq, draft), self.cfg)
        tokens, q = ([*draft, guess[0]], [*q, guess[1]]) if guess else (draft, q)
        return speculative_verify(tokens, torch.stack(q) if q else None, p, self.generator)

    def footprint(self, drafter: Drafter | None, name: str, **more) -> Footprint:
        """What its decoding adds to its figures: acceptance counts, its level-1 drafter `name` and that drafter's
        forwards, the retrieval and level-1 caches' bytes, the plans it ran, and `more` (a schedule's own)."""
        level1 = drafter.level if drafter else None
        return Footprint(self.counts, name, drafter.steps if drafter else 0,
                         self.retrieval.cache.nbytes if self.retrieval else 0, level1.cache.nbytes if level1 else 0,
                         level1.model.step_weight_bytes() if level1 else 0, plans=self.plans, **more)

    def emit(self, tokens: list[int], provenance: list[str], round_: int) -> Event:
        """A round's accepted drafts and level 3's token join the answer; the event that shows them."""
        self.seq += tokens
        return self.out.add(tokens, provenance, round_)
