"""Generation settings and the errors bad input raises."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, Union

Method = Literal["triforce", "ar"]
DrafterName = Literal["model", "ngram", "none"]
Reselect = Union[Literal["once", "every_verify"], int]


class TriForceError(ValueError):
    """Bad input or settings; the message says what to change."""


class ContextOverflowError(TriForceError):
    """The document does not fit the model's context and the caller asked to refuse."""


class TokenizerMismatchError(TriForceError):
    """The draft model's tokenizer differs from the target's."""


class ModelNotFoundError(TriForceError):
    """A model path or id could not be resolved offline."""


@dataclass
class GenerationConfig:
    """Everything one generation needs besides the models and the input."""

    method: Method = "triforce"
    max_new_tokens: int = 256
    budget: int = 4096
    chunk_size: int = 8
    gamma1: int = 2
    gamma2: int = 6
    drafter: DrafterName | None = None  # None: `model` if a draft model is loaded, else `ngram`
    reselect: Reselect = "once"
    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0
    greedy: bool = False
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    overflow: Literal["truncate", "refuse"] = "truncate"
    sink_tokens: int = 16
    window_tokens: int = 240
    ngram_max: int = 4
    draft_confidence: float = 0.0  # the model drafter stops proposing when its top probability falls below this
    lookup_min: int = 4  # the model drafter copies the continuation of an earlier match this long; 0: never
    draft_fusion: bool = True  # a draft with a fusion module reads the target's hidden states; False: the draft alone
    prefill_chunk: int | None = None  # tokens per prefill forward; None: 2048 on a CPU, as many as fit on a GPU

    def validate(self) -> "GenerationConfig":
        """Raise TriForceError naming the first bad setting; return self when all are valid."""
        checks = [
            (self.method in ("triforce", "ar"), f"method must be 'triforce' or 'ar', got {self.method!r}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}"),
            (self.budget >= self.chunk_size, f"budget ({self.budget}) must be at least chunk_size ({self.chunk_size})"),
            (self.budget % self.chunk_size == 0,
             f"budget ({self.budget}) must be a multiple of chunk_size ({self.chunk_size})"),
            (self.gamma1 >= 1, f"gamma1 must be >= 1, got {self.gamma1}"),
            (self.gamma2 >= 1, f"gamma2 must be >= 1, got {self.gamma2}"),
            (self.drafter in (None, "model", "ngram", "none"),
             f"drafter must be 'model', 'ngram' or 'none', got {self.drafter!r}"),
            (self.reselect in ("once", "every_verify") or (isinstance(self.reselect, int) and self.reselect >= 1),
             f"reselect must be 'once', 'every_verify' or a positive integer, got {self.reselect!r}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.overflow in ("truncate", "refuse"), f"overflow must be 'truncate' or 'refuse', got {self.overflow!r}"),
            (self.sink_tokens >= 1 and self.window_tokens >= 1, "sink_tokens and window_tokens must be >= 1"),
            (self.ngram_max >= 1, f"ngram_max must be >= 1, got {self.ngram_max}"),
            (0 <= self.draft_confidence < 1, f"draft_confidence must be in [0, 1), got {self.draft_confidence}"),
            (self.lookup_min >= 0, f"lookup_min must be >= 0, got {self.lookup_min}"),
            (self.prefill_chunk is None or self.prefill_chunk >= 1,
             f"prefill_chunk must be >= 1 or None, got {self.prefill_chunk}"),
        ]
        for ok, message in checks:
            if not ok:
                raise TriForceError(message)
        return self

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)
