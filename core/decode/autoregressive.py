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
from core.decode.request import chains
from core.decode.sampling import distributions, draw, sample


NEAR_TIE = 1.0  # greedy runs record the steps whose top two logits are closer than this (rounding can swap them)
# Tokens decoded on a GPU between two read-backs: each token is drawn on the device and fed straight into the next
# step, so the host queues a step while the device runs the one before (read back after every token, a step of the
# 1.5B at 30K kept the H100 busy 68 % of its wall time: bench.gpu_profile --parts steps). A stop is seen at the next
# read-back: at most READ_BACK - 1 steps are computed in vain, their tokens dropped.
READ_BACK = 8


def read_back(cfg: GenerationConfig, device: torch.device) -> int:
    """Tokens per read-back: READ_BACK on a GPU where draws may stay on the device (core.decode.request.chains),
    else 1 (a CPU computes each step while the host waits anyway)."""
    return READ_BACK if device.type == "cuda" and chains(cfg) else 1


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
        piece = read_back(cfg, target.model.device)
        while not out.done:
            t0 = clock(target.graphs)
            if piece == 1:
                token, _, logits = next_token(target, seq, repetition, cfg, self.generator)
                tokens, margins = [token], [self.margin(logits)]
            else:
                tokens, margins = self.decode_piece(seq, piece)
            ms = (clock(target.graphs) - t0) * 1e3 / len(tokens)
            for token, margin in zip(tokens, margins):
                if out.done:  # decoded past a stop: dropped (the level rolls its cache back when next fed)
                    break
                if step:  # a first eager step may still compile kernels (a graph's capture is not on the clock)
                    self.observe(RoundRecord(AUTOREGRESSIVE, level3_ms=ms, level3_wall_ms=ms))
                if margin is not None:
                    self.margins.append(margin)
                seq.append(token)
                yield out.add([token], ["target"], step)
                yield StepTiming(round=step, level1_ms=0.0, level2_ms=0.0, level3_ms=ms, selection_ms=0.0, tokens=1)
                step += 1

    def decode_piece(self, seq: list[int], n: int) -> tuple[list[int], list[torch.Tensor | None]]:
        """decode_piece's tokens and each step's greedy margin."""
        tokens, steps = decode_piece(self.target, seq, n, self.cfg, self.generator)
        return tokens, [self.margin(logits) for _, logits in steps]

    def margin(self, logits: torch.Tensor) -> torch.Tensor | None:
        """A greedy step's top-two logit margin, on the device (None when sampling)."""
        if not self.cfg.is_greedy:
            return None
        top = logits[0].topk(2).values
        return top[0] - top[1]

    def footprint(self) -> Footprint:
        """No drafts and no other caches; the greedy steps decided by a near-tie, with their margins."""
        margins = torch.stack(self.margins).tolist() if self.margins else []
        return Footprint(near_ties=[(i, m) for i, m in enumerate(margins) if m < NEAR_TIE])


def decode_piece(target: Level, seq: list[int], n: int, cfg: GenerationConfig, generator: torch.Generator
                 ) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """n autoregressive tokens after seq, each drawn on the device and fed into the next step, read back together
    (one wait): the draws of n single steps, in their order, so the same tokens. Also each step's hidden state
    [1, D] and logits [1, V] (the token came from them)."""
    hidden = target.states(seq, 1, len(seq) - 1)
    ids, steps = [], []
    for i in range(n):
        if i:
            hidden = target.follow(ids[-1])
        logits = target.head(hidden)
        steps.append((hidden, logits))
        ids.append(draw(distributions(logits, cfg)[0], generator))
    tokens = torch.cat(ids).tolist()
    target.settle(tokens[:-1])
    return tokens, steps
