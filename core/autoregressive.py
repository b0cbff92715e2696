"""Plain autoregressive decoding on the same model code and full cache: the baseline."""

from __future__ import annotations

import time
from typing import Iterator

import torch

from core.config import GenerationConfig
from core.events import Event, StepTiming
from core.levels import Level
from core.output import Output
from core.repetition import Repetition
from core.sampling import distributions, sample


def autoregressive(target: Level, prompt: list[int], cfg: GenerationConfig, generator: torch.Generator,
                   out: Output) -> Iterator[Event]:
    """One target forward per token until `out` says stop."""
    seq = list(prompt)
    step = 0
    repetition = Repetition(cfg, target.model.args.vocab_size, target.model.device, len(prompt))
    while not out.done:
        t0 = time.perf_counter()
        p = distributions(repetition(target.logits(seq, 1, len(seq) - 1), seq), cfg)
        token = sample(p[0], generator)
        ms = (time.perf_counter() - t0) * 1e3
        seq.append(token)
        yield out.add([token], ["target"], step)
        yield StepTiming(step, 0.0, 0.0, ms, 0.0, 1)
        step += 1
