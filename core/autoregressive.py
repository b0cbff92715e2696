"""Plain autoregressive decoding on the same model code and full cache: the baseline."""

from __future__ import annotations

import time
from typing import Iterator

import torch

from core.config import GenerationConfig
from core.events import Event, Footprint, StepTiming
from core.levels import Level
from core.output import Output
from core.repetition import Repetition
from core.sampling import distributions, sample


class Autoregressive:
    """One target forward per token until `out` says stop; the target level's cache must hold prompt[:-1]."""

    def __init__(self, target: Level, prompt: list[int], cfg: GenerationConfig, generator: torch.Generator,
                 out: Output):
        self.target, self.prompt, self.cfg, self.generator, self.out = target, prompt, cfg, generator, out

    def run(self) -> Iterator[Event]:
        """Each token's event and timing."""
        target, cfg, out = self.target, self.cfg, self.out
        seq = list(self.prompt)
        step = 0
        repetition = Repetition(cfg, target.model.args.vocab_size, target.model.device, len(seq))
        while not out.done:
            t0 = time.perf_counter()
            p = distributions(repetition(target.logits(seq, 1, len(seq) - 1), seq), cfg)
            token = sample(p[0], self.generator)
            ms = (time.perf_counter() - t0) * 1e3
            seq.append(token)
            yield out.add([token], ["target"], step)
            yield StepTiming(step, 0.0, 0.0, ms, 0.0, 1)
            step += 1

    def footprint(self) -> Footprint:
        """Nothing beside the full cache and the target: no drafts, no other caches."""
        return Footprint()
