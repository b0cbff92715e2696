"""Generation settings, each declared once with its help, range and choices (the CLI flags and the app's Settings
panel are built from them), and the errors bad input raises."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Union

Method = Literal["auto", "triforce", "ar"]


@dataclass(frozen=True)
class MethodKind:
    """What a method's name means, resolved once (GenerationConfig.kind): whether level 2 drafts for level 3 (the
    request holds a retrieval cache) and whether a planner chooses each round's levels and γs (method auto) or the
    settings fix them."""

    drafts: bool
    planned: bool


METHODS = {"auto": MethodKind(True, True), "triforce": MethodKind(True, False), "ar": MethodKind(False, False)}
Reselect = Union[str, int]
SEED_LIMIT = 2**63  # torch generators take seeds below this
# The most new tokens one decode step takes: such a forward reads its lengths from device memory (CUDA graphs) and
# computes each row as a one-token step would (batch-invariant kernels); a longer input is fed in pieces of this size.
DECODE_TOKENS = 32
AUTO_GAMMA2 = DECODE_TOKENS - 1  # method auto's longest level-3 draft: its γ2 + 1 rows fill one decode step
# A batch decodes SEATS requests together unless told otherwise, at most MAX_SLOTS (the paper batches up to 10), as
# memory allows; its steps feed at most DECODE_TOKENS rows per request, each row computed as a one-row step.
SEATS = 8
MAX_SLOTS = 16
BATCH_TOKENS = MAX_SLOTS * DECODE_TOKENS


class TriForceError(ValueError):
    """Bad input or settings; the message says what to change."""


class ContextOverflowError(TriForceError):
    """The document does not fit the model's context and the caller asked to refuse."""


class TokenizerMismatchError(TriForceError):
    """The draft model's tokenizer differs from the target's."""


class ModelNotFoundError(TriForceError):
    """A model path or id could not be resolved offline."""


class UnusableModelError(TriForceError):
    """A model was found but cannot be used: a corrupt file, an unsupported architecture, or its own code to run."""


# The names the registries hold (core.decode.drafters.DRAFTERS, core.cache.retrieval.SELECTION_POLICIES and
# LEVEL2_CACHES), spelled here so that this module needs nothing above it; a test checks that the two lists agree.
DRAFTER_CHOICES = ("auto", "model", "ngram", "none")
POLICY_CHOICES = ("once", "every_verify")
LEVEL2_CACHE_CHOICES = ("retrieval", "streaming")


def parse_reselect(text: str | int) -> Reselect:
    """A re-selection setting from text: a policy name, or a whole number N (every N verifications)."""
    if isinstance(text, int) or (isinstance(text, str) and text.strip().isdigit()):
        return int(text)
    return str(text).strip()


@dataclass(frozen=True)
class Setting:
    """How one setting is described and bounded: help, label, range, choices, how text becomes a value, the step of
    its slider, and whether the CLI and app show it."""

    help: str
    label: str = ""
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    step: float | None = None
    app: bool = True
    cli: bool = True


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A dataclass field carrying its Setting (a list default becomes a factory)."""
    meta = {"setting": Setting(help, **spec)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class GenerationConfig:
    """Everything one generation needs besides the models and the input."""

    method: Method = setting("auto", "decoding method: auto (the engine chooses which levels draft and their γs from "
                             "measured costs, round by round), triforce (always levels 1 → 2 → 3 at the γs set) or ar "
                             "(autoregressive)", label="Method", choices=("auto", "triforce", "ar"), app=False)
    max_new_tokens: int = setting(128, "answer length limit in tokens", label="Max new tokens", low=1, high=32768)
    budget: int | None = setting(None, "retrieval budget in tokens (a multiple of the chunk size; default 4096, or "
                                 "8192 with the full cache offloaded)", label="Retrieval budget (tokens)", low=1,
                                 high=1 << 20)
    chunk_size: int = setting(8, "tokens per retrieval chunk", label="Chunk size (tokens)", low=1, high=64)
    gamma1: int = setting(2, "level-1 tokens per level-2 verification", label="γ1 (level-1 draft length)",
                          low=1, high=16)
    gamma2: int | None = setting(None, "level-2 tokens per level-3 verification (default 6, or 12 with the full cache "
                                 f"offloaded; method auto: the most it may choose, default {AUTO_GAMMA2})",
                                 label="γ2 (level-2 draft length)", low=1, high=32)
    drafter: str = setting("auto", "level-1 drafter (auto: the draft model if one is loaded, else ngram)",
                           label="Level-1 drafter", choices=DRAFTER_CHOICES)
    reselect: Reselect = setting("once", "when to choose the retrieved chunks again: a policy or every N "
                                 "verifications", label="Re-select chunks", choices=POLICY_CHOICES,
                                 parse=parse_reselect, low=1)
    level2_cache: str = setting("retrieval", "level 2's cache of the prompt at the same budget: the retrieved chunks, "
                                "or StreamingLLM's first sink_tokens and most recent tokens (the paper's ablation)",
                                label="Level-2 cache", choices=LEVEL2_CACHE_CHOICES)
    temperature: float = setting(0.6, "sampling temperature (0: greedy)", label="Temperature", low=0.0, high=2.0,
                                 step=0.05)
    top_p: float = setting(0.9, "nucleus sampling mass", label="Top-p", low=0.01, high=1.0, step=0.01)
    top_k: int = setting(0, "sample among the k most likely tokens (0: all)", label="Top-k", low=0, high=1 << 20)
    repetition_penalty: float = setting(1.0, "CTRL's repetition penalty on the target: the logits of every token "
                                        "already in the answer divided by this (negative ones multiplied; 1: off)",
                                        label="Repetition penalty", low=1.0, high=3.0, step=0.05)
    no_repeat_ngram_size: int = setting(0, "the target never repeats an n-gram of this many tokens within the answer "
                                        "(0: off)", label="No repeated n-gram", low=0, high=64)
    greedy: bool = setting(False, "greedy decoding (token-identical to autoregressive)", label="Greedy")
    seed: int = setting(0, "random seed (0 to 2^63 - 1)", label="Seed", low=0, high=SEED_LIMIT - 1)
    stop: list[str] = setting([], "stop string (repeatable)", label="Stop strings", app=False)
    overflow: str = setting("truncate", "a document longer than the context: drop its middle, or refuse",
                            label="Overlong document", choices=("truncate", "refuse"))
    sink_tokens: int = setting(16, "StreamingLLM sink tokens of the level-1 cache (and of level 2's with "
                               "level2_cache streaming)", label="Sink tokens (StreamingLLM)", low=1, high=4096)
    window_tokens: int = setting(240, "StreamingLLM recent window of the level-1 cache", label="Draft window tokens",
                                 low=1, high=65536)
    ngram_max: int = setting(4, "longest n-gram the prompt lookup matches", label="Longest n-gram", low=1, high=64)
    draft_confidence: float = setting(0.0, "the model drafter stops proposing when its top probability is below "
                                      "this (0: never)", label="Draft confidence gate", low=0.0, high=0.99, step=0.05)
    lookup_min: int = setting(4, "the model drafter copies what followed an earlier match of this many tokens "
                              "(0: never)", label="Copy after a match of", low=0, high=64)
    draft_fusion: bool = setting(True, "a draft with a fusion module reads the target's hidden state (off: the draft "
                                 "alone)", label="Draft fusion")
    prefill_chunk: int | None = setting(None, "tokens per prefill forward (default: 2048 on a CPU, as many as fit "
                                        "on a GPU)", label="Prefill chunk", low=1, high=1 << 24, app=False)
    offload: str = setting("auto", "keep the full KV cache in CPU memory and stream it to the GPU layer by layer "
                           "(auto: when it does not fit the GPU)", label="Offload the full KV cache",
                           choices=("auto", "on", "off"))
    draft_ahead: str = setting("auto", "level 2 drafts the next round while level 3 verifies this one, kept when "
                               "level 3 accepts every draft and then level 2's guess (auto: when the full cache "
                               "streams from CPU memory to a GPU, which then waits on copies; method auto then weighs "
                               "each plan with and without it)", label="Draft ahead",
                               choices=("auto", "on", "off"))

    def validate(self) -> GenerationConfig:
        """Raise TriForceError naming the first bad setting; return self when all are valid."""
        hints = type_hints()
        for f in dataclasses.fields(self):
            check(f.name, getattr(self, f.name), hints[f.name], f.metadata["setting"])
        if self.budget is not None and self.budget % self.chunk_size:
            raise TriForceError(f"budget ({self.budget}) must be a multiple of chunk_size ({self.chunk_size})")
        if self.budget is not None and self.budget < self.chunk_size:
            raise TriForceError(f"budget ({self.budget}) must be at least chunk_size ({self.chunk_size})")
        return self

    def resolved(self, offloaded: bool) -> GenerationConfig:
        """A copy with the regime's defaults filled in: budget 4096 and γ2 6 on-chip, 8192 and 12 offloaded (the
        paper's settings for each); method auto bounds γ2 by AUTO_GAMMA2."""
        gamma2 = AUTO_GAMMA2 if self.kind.planned else 12 if offloaded else 6
        return dataclasses.replace(self, budget=self.budget or (8192 if offloaded else 4096),
                                   gamma2=self.gamma2 or gamma2).validate()

    @property
    def lookahead(self) -> int:
        """Tokens past the committed sequence a cache may be fed in one round (level 2's draft, level 1's proposals
        and the token before them, plus one): caches hold the prompt, the answer and this much more. It covers the
        longest round of any method (auto may draft AUTO_GAMMA2), so that runs of different methods on one prompt
        share their caches. Resolved settings only (γ2 known)."""
        return self.gamma1 + max(self.gamma2, AUTO_GAMMA2) + 2

    @property
    def kind(self) -> MethodKind:
        return METHODS[self.method]

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


@functools.cache
def type_hints() -> dict[str, Any]:
    """GenerationConfig's annotations evaluated once (they are strings here: evaluating them compiles each)."""
    return typing.get_type_hints(GenerationConfig)


def settings() -> dict[str, tuple[dataclasses.Field, Setting]]:
    """Every setting by name, in declaration order."""
    return {f.name: (f, f.metadata["setting"]) for f in dataclasses.fields(GenerationConfig)}


def value_types(hint: Any) -> tuple[type, ...]:
    """The Python types a setting's annotation allows (a Literal's values are strings)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return (str,)
    if origin in (Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in value_types(arg))
    return (origin or hint,)


BRIEF_CHARS = 60  # the most of a refused value a message repeats: enough to recognise it, never a flood


def brief(value: Any) -> str:
    """A refused value as a message shows it: its repr, cut to BRIEF_CHARS characters and an ellipsis (a long string
    is cut before its repr is taken: a million characters are not copied to show sixty)."""
    if isinstance(value, (str, bytes)):
        value = value[:BRIEF_CHARS + 1]
    text = repr(value)
    return text if len(text) <= BRIEF_CHARS else text[:BRIEF_CHARS] + "…"


def check(name: str, value: Any, hint: Any, spec: Setting) -> None:
    """Raise TriForceError unless value fits the setting's type, range and choices."""
    kinds = value_types(hint)
    number = float in kinds or int in kinds
    if value is None and type(None) in kinds or isinstance(value, bool) and bool in kinds:
        return
    if isinstance(value, list) and list in kinds and all(isinstance(v, str) for v in value):
        return
    if isinstance(value, str) and str in kinds:
        choices = spec.choices
        if choices is not None and value not in choices:
            raise TriForceError(f"{name} must be one of {', '.join(map(str, choices))}"
                                f"{' or a whole number' if int in kinds else ''}, got {brief(value)}")
        return
    ok_type = isinstance(value, int) if float not in kinds else isinstance(value, (int, float))
    if not number or isinstance(value, bool) or not ok_type:
        choices = spec.choices
        want = "a number" if float in kinds else "a whole number" if int in kinds else \
            "true or false" if bool in kinds else "a list of strings" if list in kinds else \
            f"one of {', '.join(map(str, choices))}" if choices else "a string"
        raise TriForceError(f"{name} must be {want}, got {brief(value)}")
    if value != value or (spec.low is not None and value < spec.low) or (spec.high is not None and value > spec.high):
        bounds = f">= {spec.low}" if spec.high is None else f"between {spec.low} and {spec.high}"
        raise TriForceError(f"{name} must be {bounds}, got {brief(value)}")
