"""Typed events of one generation: plain Python data only, so a UI process, the CLI and benchmarks share them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal

# Where an emitted token came from.
Provenance = Literal["draft", "copy", "level2", "level3", "target"]
# Each provenance in words: the one vocabulary of every legend (the app's answer and timeline, the CLI's colours).
PROVENANCE_LABELS: dict[str, str] = {
    "draft": "level-1 draft, accepted",  # proposed by level 1, accepted by level 2 and by level 3
    "copy": "level-1 copy from the text, accepted",  # the same, copied from earlier in the text (prompt lookup)
    "level2": "level-2 correction/bonus",  # sampled by level 2 after a rejection or a full acceptance, kept by level 3
    "level3": "level-3 correction/bonus",  # level 3's own token after a rejection or a full acceptance
    "target": "autoregressive",  # a step that drafted nothing: the target alone on its full cache
}


@dataclass
class Event:
    """Base class: every event serialises to a dict with a `kind` key."""

    def to_dict(self) -> dict:
        """The event's fields by name; lists are the event's own, not copies (a selection's chunk ids run to
        hundreds of thousands, which dataclasses.asdict copied one by one: 30 ms at 8K tokens, 190 ms at 120K, on
        the decoding thread)."""
        return {"kind": type(self).__name__, **{f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass
class Loading(Event):
    """Model load progress (0..1)."""

    stage: str
    fraction: float


@dataclass
class PromptReady(Event):
    """The prompt is tokenised; says whether the document was truncated and by how much."""

    prompt_tokens: int
    document_tokens: int
    dropped_tokens: int
    context_length: int
    max_new_tokens: int
    chunk_size: int
    chunk_texts: list[str]  # decoded text of each prompt chunk (for hover / highlighting)
    offloaded: bool = False  # the full KV cache lives in CPU memory, streamed to the GPU layer by layer
    caches: dict = field(default_factory=dict)  # name -> {"where": "GPU" | "CPU", "bytes": int}


@dataclass
class PrefillProgress(Event):
    """Prefill has processed `done` of `total` prompt tokens."""

    done: int
    total: int
    seconds: float
    cache_bytes: int  # the full KV cache's size
    reused: bool = False  # the previous run's cache already held this prompt
    decoding_beside: int = 0  # (batched) other requests decoding meanwhile: this prompt is read between their rounds


@dataclass
class RetrievalSelection(Event):
    """Chunks the retrieval cache keeps: chunk_ids[layer][kv_head] is a sorted list of chunk indices."""

    round: int
    position: int
    chunk_size: int
    num_chunks: int
    prompt_tokens: int
    budget: int
    chunk_ids: list[list[list[int]]]
    seconds: float
    cache_bytes: int  # the retrieval cache's size


@dataclass
class DraftProposal(Event):
    """Level-1 proposals for one level-2 verification; `copied`: which came from prompt lookup, not a draft model."""

    round: int
    tokens: list[int]
    copied: list[bool] = field(default_factory=list)


@dataclass
class Verdict(Event):
    """One speculative verification at `level` (2 or 3): the first `accepted` proposals were kept;
    `token` follows them (a correction if accepted < len(proposed), else a bonus)."""

    level: int
    round: int
    proposed: list[int]
    accepted: int
    token: int
    bonus: bool


@dataclass
class Tokens(Event):
    """Tokens appended to the answer, with their decoded text pieces and provenance."""

    ids: list[int]
    texts: list[str]
    provenance: list[Provenance]
    round: int


@dataclass
class PlanChosen(Event):
    """From round `round` on, the hierarchy the planner chose (method auto) and why: which levels draft (level1:
    the drafter, "" for none), how many tokens (gamma2 0: autoregressive), and whether level 2 drafts ahead."""

    round: int
    plan: str
    reason: str
    level1: str
    level2: bool
    gamma1: int
    gamma2: int
    ahead: bool = False


@dataclass
class PrefillBeside(Event):
    """A batched request's device also prefills another request's prompt of `prompt_tokens` tokens between its rounds
    (0: that prefill ended), on `device` (a torch device's name): its rounds come slower meanwhile."""

    prompt_tokens: int
    device: str


@dataclass
class StepTiming(Event):
    """Wall time of one level-3 round, split by level (milliseconds), the tokens it emitted and the level-2 forwards
    its draft took (made ahead or not)."""

    round: int
    level1_ms: float
    level2_ms: float
    level3_ms: float
    selection_ms: float
    tokens: int
    level2_forwards: int = 0


def verified(proposed: int, accepted: int) -> int:
    """Drafts a verification looked at: the accepted ones, and the one it rejected, if any (it stops there)."""
    return accepted + (accepted < proposed)


@dataclass
class Acceptance:
    """Tokens each level proposed to the level above, how many that level verified and how many it accepted. A draft
    after a rejected one is never verified, so the acceptance, accepted / verified, is the per-token probability a
    draft passes (what the paper reports); accepted / proposed would also fall with longer drafts."""

    level1_proposed: int = 0
    level1_verified: int = 0
    level1_accepted: int = 0
    level2_proposed: int = 0
    level2_verified: int = 0
    level2_accepted: int = 0

    def count(self, level: int, proposed: int, accepted: int) -> None:
        """One verification of `proposed` drafts from `level` (1 or 2), the first `accepted` of them kept."""
        looked = verified(proposed, accepted)
        if level == 1:
            self.level1_proposed, self.level1_verified = self.level1_proposed + proposed, self.level1_verified + looked
            self.level1_accepted += accepted
        else:
            self.level2_proposed, self.level2_verified = self.level2_proposed + proposed, self.level2_verified + looked
            self.level2_accepted += accepted

    @property
    def level1_acceptance(self) -> float:
        return self.level1_accepted / self.level1_verified if self.level1_verified else 0.0

    @property
    def level2_acceptance(self) -> float:
        return self.level2_accepted / self.level2_verified if self.level2_verified else 0.0


@dataclass
class Footprint:
    """What a decoding method adds to its run's figures: acceptance counts, its level-1 drafter and that drafter's
    forwards, and the bytes of the caches and draft weights it used beside the full cache and the target."""

    counts: Acceptance = field(default_factory=Acceptance)
    drafter: str = ""
    level1_steps: int = 0
    retrieval_cache_bytes: int = 0
    level1_cache_bytes: int = 0
    level1_weight_bytes: int = 0
    near_ties: list[tuple[int, float]] = field(default_factory=list)  # (answer token, top-two logit margin)
    plans: list[str] = field(default_factory=list)  # the hierarchies a planner chose, in order
    ahead_made: int = 0  # next-round drafts level 2 made while level 3 verified (TriForce.draft_ahead)
    ahead_kept: int = 0  # ... and those a round used


@dataclass(kw_only=True)
class Stats(Acceptance):
    """Figures of a finished generation."""

    method: str
    new_tokens: int
    prompt_tokens: int
    dropped_tokens: int
    prefill_s: float
    prefill_reused: bool
    decode_s: float  # decoding wall time, less warmup_s
    tokens_per_s: float
    time_to_first_token_s: float
    target_forwards: int
    tokens_per_target_forward: float
    level1_steps: int = 0  # forwards of a level-1 draft model
    drafter: str = ""  # the level-1 drafter that ran (model, ngram, none; "" for autoregressive)
    cache_bytes: int = 0
    retrieval_cache_bytes: int = 0
    level1_cache_bytes: int = 0  # the level-1 draft model's StreamingLLM cache
    target_weight_bytes: int = 0  # weights one target forward reads (all but the embedding table unless tied)
    level1_weight_bytes: int = 0  # the same for the level-1 draft model (0: none ran)
    stop_reason: str = ""
    device: str = ""
    dtype: str = ""
    settings: dict = field(default_factory=dict)
    warmup_s: float = 0.0  # capturing CUDA graphs and compiling kernels for shapes first seen in this run
    offloaded: bool = False
    host_link_bytes: int = 0  # bytes copied between CPU and GPU memory while decoding (offloaded full cache)
    near_ties: list[tuple[int, float]] = field(default_factory=list)  # greedy AR: tokens its top two logits nearly tied
    plans: list[str] = field(default_factory=list)  # method auto: the hierarchies chosen, in order
    ahead_made: int = 0  # next-round drafts level 2 made while level 3 verified
    ahead_kept: int = 0  # ... and those a round used
    shared_with: int = 0  # the most other requests decoded beside it in one batched round (0: it ran alone)
    prefills_beside: int = 0  # other requests prefilled between its batched rounds (their prompts read on its device)
    prefill_beside_s: float = 0.0  # ... and the seconds of its decoding their prefill took

    @classmethod
    def of(cls, footprint: Footprint, **figures) -> "Stats":
        """A run's stats: the decoding method's footprint and the engine's own figures."""
        parts = {k: v for k, v in vars(footprint).items() if k != "counts"}
        return cls(**asdict(footprint.counts), **parts, **figures)

    def to_dict(self) -> dict:
        return {**asdict(self), "level1_acceptance": self.level1_acceptance,
                "level2_acceptance": self.level2_acceptance}

    @classmethod
    def from_dict(cls, data: dict) -> "Stats":
        """The Stats a to_dict() came from (its derived ratios are properties again)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass
class Finished(Event):
    """Generation ended; `text` is the whole answer."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: Stats

    def to_dict(self) -> dict:
        return {"kind": "Finished", "text": self.text, "token_ids": self.token_ids,
                "prompt_ids": self.prompt_ids, "stats": self.stats.to_dict()}


EVENT_KINDS: dict[str, type[Event]] = {cls.__name__: cls for cls in Event.__subclasses__()}


def event_from_dict(data: dict) -> Event:
    """The typed event a dict from Event.to_dict() came from: what a process that received plain data (a UI, a
    ZeroGPU worker's caller) folds."""
    values = {k: v for k, v in data.items() if k != "kind"}
    cls = EVENT_KINDS.get(data.get("kind", ""))
    if cls is None:
        raise ValueError(f"unknown event kind {data.get('kind')!r}")
    if cls is Finished:
        values["stats"] = Stats.from_dict(values["stats"])
    return cls(**values)
