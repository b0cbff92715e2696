"""Plain autoregressive decoding on the same model code and full cache: the baseline."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from core.config import GenerationConfig
from core.decode.graphs import clock
from core.events import Event, Footprint, StepTiming
from core.decode.levels import Level
from core.decode.output import Output
from core.decode.repetition import Repetition
from core.decode.round import AUTOREGRESSIVE, RoundRecord
from core.decode.sampling import distributions, sample


NEAR_TIE = 1.0  # greedy runs record the steps whose top two logits are closer than this (rounding can swap them)


def next_token(target: Level, seq: list[int], repetition: Repetition, cfg: GenerationConfig,
               generator: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One autoregressive step: the token after seq, the target's hidden state [1, D] and the logits [1, V] it came
    from (method auto's autoregressive rounds take this very step)."""
    hidden = target.states(seq, 1, len(seq) - 1)
    logits = repetition(target.head(hidden), seq)
    return sample(distributions(logits, cfg)[0], generator), hidden, logits


class Autoregressive:
    """One target forward per token until `out` says stop; the target level's cache must hold prompt[:-1]. Greedy
    runs also note each step's top-two logit margin, so that a comparison can say where a near-tie was decided.
    `observe` receives each step's record (what a step costs: a later auto run starts from it)."""

    def __init__(self, target: Level, prompt: list[int], cfg: GenerationConfig, generator: torch.Generator,
                 out: Output, observe: Callable[[RoundRecord], None] = lambda record: None):
        self.target, self.prompt, self.cfg, self.generator, self.out = target, prompt, cfg, generator, out
        self.observe = observe
        self.margins: list[torch.Tensor] = []  # per greedy step, on the device (read once, at the end)

    def prepare(self) -> Iterator[Event]:
        """Nothing to prepare beside the prefilled cache."""
        return iter(())

    def run(self) -> Iterator[Event]:
        """Each token's event and timing."""
        target, cfg, out = self.target, self.cfg, self.out
        seq = list(self.prompt)
        step = 0
        repetition = Repetition(cfg, target.model.args.vocab_size, target.model.device, len(seq))
        while not out.done:
            t0 = clock(target.graphs)
            token, _, logits = next_token(target, seq, repetition, cfg, self.generator)
            if cfg.is_greedy:
                top = logits[0].topk(2).values
                self.margins.append(top[0] - top[1])
            ms = (clock(target.graphs) - t0) * 1e3
            if step:  # a first eager step may still compile kernels (a graph's capture is not on the clock)
                self.observe(RoundRecord(AUTOREGRESSIVE, level3_ms=ms, level3_wall_ms=ms))
            seq.append(token)
            yield out.add([token], ["target"], step)
            yield StepTiming(round=step, level1_ms=0.0, level2_ms=0.0, level3_ms=ms, selection_ms=0.0, tokens=1)
            step += 1

    def footprint(self) -> Footprint:
        """No drafts and no other caches; the greedy steps decided by a near-tie, with their margins."""
        margins = torch.stack(self.margins).tolist() if self.margins else []
        return Footprint(near_ties=[(i, m) for i, m in enumerate(margins) if m < NEAR_TIE])
