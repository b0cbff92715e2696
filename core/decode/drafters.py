"""Level-1 drafters behind one interface: a small LM with a StreamingLLM cache, or prompt lookup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import torch

from core.config import GenerationConfig, TriForceError
from core.decode.graphs import Graphs
from core.cache.kvcache import StreamingCache
from core.decode.levels import Level
from core.model.transformer import Transformer
from core.model.parallel import agree
from core.decode.repetition import Repetition
from core.decode.sampling import distributions, sample


class Proposal(NamedTuple):
    """Level-1 tokens, their proposal distributions q [k, V] (None: all deterministic), and which were copied from
    earlier in the text (prompt lookup) rather than drawn from a draft model."""

    tokens: list[int]
    q: torch.Tensor | None
    copied: list[bool]


class Drafter(Protocol):
    """Proposes up to n tokens continuing seq + extra (`trusted`: a length up to which seq did not change since the
    last call; `extra`: the newest tokens, passed apart so that a long seq is never copied; `feature`: the target's
    normed hidden state that produced the last of them, when known)."""

    name: str
    steps: int  # forwards of a draft model so far
    level: Level | None  # the draft model with its cache (None: no model drafts)
    in_passing: bool  # cheap enough (no model) to be asked each round what it would have drafted (TriForce.shadow)

    def propose(self, seq: list[int], n: int, trusted: int, extra: Sequence[int] = (),
                feature: torch.Tensor | None = None) -> Proposal: ...


@dataclass
class DraftContext:
    """What a drafter may use: the draft model (None when none is loaded), the settings, the prompt ids, the
    target's vocabulary size, the shared generator, the engine's CUDA graphs, and where the draft model's
    StreamingLLM cache comes from (core.cache.memory hands it out, asked only by the drafter that needs one)."""

    draft: Transformer | None
    cfg: GenerationConfig
    prompt: list[int]
    vocab_size: int
    generator: torch.Generator
    streaming_cache: Callable[[], StreamingCache]
    graphs: Graphs | None = None


class NgramDrafter:
    """Prompt lookup: continue the longest recent suffix n-gram found earlier in the document or output. The
    prompt's n-grams are indexed when it is made (before decoding: 10-20 ms at 8K tokens, which a first proposal
    would otherwise pay, and be judged by); the answer's as it grows."""

    name = "ngram"
    steps = 0
    level = None
    in_passing = True

    def __init__(self, max_n: int, prompt: Sequence[int] = ()):
        self.max_n = max_n
        self.index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (last end, previous end)
        self.indexed = 0
        self._extend(list(prompt), len(prompt))

    def _extend(self, seq: list[int], upto: int) -> None:
        for end in range(self.indexed + 1, upto + 1):
            for m in range(1, min(self.max_n, end) + 1):
                key = tuple(seq[end - m:end])
                self.index[key] = (end, self.index.get(key, (-1, -1))[0])
        self.indexed = max(self.indexed, upto)

    def match(self, seq: list[int], trusted: int, extra: Sequence[int] = ()) -> tuple[int, int]:
        """(m, end): the last m tokens of seq + extra (m as large as possible, <= max_n) also end at `end` earlier;
        (0, -1): none."""
        self._extend(seq, trusted)
        total = len(seq) + len(extra)
        tail = seq[-self.max_n:] + list(extra)
        for m in range(min(self.max_n, total), 0, -1):
            last, previous = self.index.get(tuple(tail[-m:]), (-1, -1))
            end = last if last != total else previous
            if end > 0:
                return m, end
        return 0, -1

    def continuation(self, seq: list[int], trusted: int, extra: Sequence[int], n: int) -> tuple[int, list[int]]:
        """(m, up to n tokens that followed the earlier occurrence of the last m tokens of seq + extra); (0, [])."""
        m, end = self.match(seq, trusted, extra)
        if not m:
            return 0, []
        return m, (seq[end:end + n] + list(extra)[max(end - len(seq), 0):max(end + n - len(seq), 0)])[:n]

    def propose(self, seq: list[int], n: int, trusted: int, extra: Sequence[int] = (),
                feature: torch.Tensor | None = None) -> Proposal:
        _, tokens = self.continuation(seq, trusted, extra, n)
        return Proposal(tokens, None, [True] * len(tokens))


class ModelDrafter:
    """A small LM sharing the target's tokenizer, reading a StreamingLLM cache (sink + recent window). With
    cfg.lookup_min, a position whose last lookup_min (or more) tokens occurred earlier in the document or answer gets
    the prompt-lookup continuation instead (proposed with certainty: q one-hot), as the draft cannot see text that
    left its window. A draft with a fusion module mixes in the target's hidden state that produced the last token
    (from level 2 or 3, which read the whole document) when the caller passes it."""

    name = "model"
    in_passing = False

    def __init__(self, model: Transformer, cfg: GenerationConfig, prompt: list[int], vocab_size: int,
                 generator: torch.Generator, cache: StreamingCache, graphs: Graphs | None = None):
        self.level = Level(model, cache, [], graphs, drafting=True)
        self.cfg, self.vocab_size, self.generator = cfg, vocab_size, generator
        self.repetition = Repetition(cfg, vocab_size, model.device, len(prompt))  # q nearer the target's penalised p
        self.lookup = NgramDrafter(max(cfg.ngram_max, cfg.lookup_min), prompt) if cfg.lookup_min else None
        self._fill(prompt[:-1])

    def _fill(self, body: list[int]) -> None:
        """Start the StreamingLLM cache over `body`: its first sink tokens and its last window (the middle is
        skipped, as the cache would have evicted it)."""
        cache, sink, window = self.level.cache, self.cfg.sink_tokens, self.cfg.window_tokens
        cache.reset()
        self.level.tokens = []
        if len(body) <= sink + window:
            list(self.level.prefill(body, len(body)))
        else:
            list(self.level.prefill(body[:sink], sink))
            cache.skip(len(body) - sink - window)
            list(self.level.prefill(body[-window:], window))
            self.level.tokens = list(body)

    def propose(self, seq: list[int], n: int, trusted: int, extra: Sequence[int] = (),
                feature: torch.Tensor | None = None) -> Proposal:
        extra = list(extra)
        if len(seq) + len(extra) - len(self.level.tokens) > self.cfg.window_tokens:  # after rounds without level 1
            self._fill(seq + extra[:-1] if extra else seq[:-1])
        tokens: list[int] = []
        qs, copied = [], []
        model = self.level.model
        ids = model.vocab_ids  # a reduced head: sample among its ids, zero mass on the others
        fuse = model.fusion is not None and feature is not None and self.cfg.draft_fusion
        for _ in range(n):
            if self.lookup is not None:
                m, follow = self.lookup.continuation(seq, trusted, extra + tokens, 1)
                if m >= self.cfg.lookup_min:
                    tokens += follow
                    qs.append(torch.nn.functional.one_hot(torch.tensor(follow[0], device=model.device),
                                                          self.vocab_size).float())
                    copied.append(True)
                    continue
            h = self.level.states(seq, 1, trusted, extra + tokens)
            # the feature produced the token before `tokens`: it lies len(tokens) + 1 positions back
            logits = self.level.head(model.fusion(h, feature, len(tokens) + 1) if fuse else h)
            q = distributions(self.repetition(logits if ids is not None else self._align(logits), seq,
                                              extra + tokens, ids), self.cfg)[0]
            if self.cfg.draft_confidence and agree(self._confidence(logits, q) < self.cfg.draft_confidence)[0]:
                break  # stopping depends on the draft alone, so verification stays exact (rank 0's call: one path)
            x = sample(q, self.generator)
            tokens.append(int(ids[x]) if ids is not None else x)
            qs.append(q.new_zeros(self.vocab_size).index_copy_(0, ids, q) if ids is not None else q)
            copied.append(False)
        return Proposal(tokens, torch.stack(qs) if qs else None, copied)

    @classmethod
    def create(cls, ctx: DraftContext) -> "ModelDrafter":
        if ctx.draft is None:
            raise TriForceError("drafter 'model' needs a draft model; load one or pick 'ngram' or 'none'")
        return cls(ctx.draft, ctx.cfg, ctx.prompt, ctx.vocab_size, ctx.generator, ctx.streaming_cache(), ctx.graphs)

    @property
    def steps(self) -> int:
        """Forwards of the draft model so far (proposed tokens plus steps whose token the confidence gate held back)."""
        return self.level.forwards

    def _confidence(self, logits: torch.Tensor, q: torch.Tensor) -> float:
        """The draft's top probability: of its softmax when greedy (q is one-hot then), else of q."""
        return float((logits.softmax(-1) if self.cfg.is_greedy else q).max())

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Map draft logits onto the target's vocabulary size (ids past the draft's vocabulary get -inf)."""
        v = logits.shape[-1]
        if v >= self.vocab_size:
            return logits[..., :self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - v), value=float("-inf"))


DRAFTERS: dict[str, Callable[[DraftContext], Drafter]] = {
    "model": ModelDrafter.create,
    "ngram": lambda ctx: NgramDrafter(ctx.cfg.ngram_max, ctx.prompt),
}


def drafter_names(setting: str, planned: bool, has_draft_model: bool) -> list[str]:
    """The level-1 drafters a run holds, the first one its default: the one a setting names ("none": no level 1).
    Setting auto names the draft model when one is loaded, else prompt lookup; where a planner chooses (method
    auto), prompt lookup as well, for it to weigh beside the model."""
    if setting == "none":
        return []
    if setting != "auto":
        return [setting]
    return ["model", "ngram"] if has_draft_model and planned else ["model" if has_draft_model else "ngram"]


def make_drafters(names: list[str], ctx: DraftContext) -> dict[str, Drafter]:
    """The drafters named, by name. Prompt lookup beside a draft model that looks up the same n-grams shares its
    index (indexing a 30K-token prompt takes ~0.2 s of Python)."""
    made = {name: DRAFTERS[name](ctx) for name in names if name != "ngram"}
    lookup = made["model"].lookup if "model" in made else None
    if "ngram" in names:
        made["ngram"] = lookup if lookup is not None and lookup.max_n == ctx.cfg.ngram_max else DRAFTERS["ngram"](ctx)
    return {name: made[name] for name in names}
