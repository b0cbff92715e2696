"""Repetition control on the target's logits over the answer so far (the document is there to be quoted), as
transformers' processors do it: RepetitionPenaltyLogitsProcessor with prompt_ignore_length = the prompt's length
(CTRL's penalty) and NoRepeatNGramLogitsProcessor on the answer's ids. Row i of a forward over the last n positions
of seq + extra continues seq + extra up to that position, so the draft tokens before it count as answer."""

from __future__ import annotations

from typing import Sequence

import torch

from core.config import GenerationConfig


class Repetition:
    """One generation's repetition control (a no-op when both settings are off); the answer starts at position
    `start`. `seq` must only grow from one call to the next, as a generation's committed sequence does: its
    answer tokens are moved to the device once."""

    def __init__(self, cfg: GenerationConfig, vocab_size: int, device: torch.device, start: int):
        self.penalty, self.ngram = cfg.repetition_penalty, cfg.no_repeat_ngram_size
        self.vocab_size, self.start = vocab_size, start
        self.ids = torch.empty(0, dtype=torch.long, device=device)  # seq[start:start + len(ids)] on the device
        self.active = self.applies(cfg)

    @staticmethod
    def applies(cfg: GenerationConfig) -> bool:
        """Whether settings `cfg` ask for any repetition control."""
        return cfg.repetition_penalty != 1.0 or cfg.no_repeat_ngram_size > 0

    def __call__(self, logits: torch.Tensor, seq: Sequence[int], extra: Sequence[int] = (),
                 columns: torch.Tensor | None = None) -> torch.Tensor:
        """logits [n, C] of the tokens after each of the last n positions of seq + extra, processed; `columns`: the
        token id of each logit column (a reduced head; None: column c is token c)."""
        if not self.active:
            return logits
        if len(seq) > self.start + len(self.ids):
            new = torch.tensor(list(seq[self.start + len(self.ids):]), dtype=torch.long, device=self.ids.device)
            self.ids = torch.cat([self.ids, new])
        rows = logits.shape[0]
        first = len(seq) + len(extra) - rows + 1  # the history length of row 0
        later = torch.tensor(list(extra), dtype=torch.long, device=self.ids.device)
        seen = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=logits.device)
        banned = torch.zeros(rows, self.vocab_size + 1, dtype=torch.bool, device=logits.device)  # + a spare column
        for i in range(rows):
            answer = torch.cat([self.ids[:max(0, first + i - self.start)], later[:max(0, first + i - len(seq))]])
            if self.penalty != 1.0:
                seen[i, answer] = True
            if self.ngram and len(answer) >= self.ngram:  # ban what followed each earlier copy of the last n - 1
                windows = answer.unfold(0, self.ngram, 1)
                match = (windows[:, :-1] == answer[len(answer) + 1 - self.ngram:]).all(-1)
                banned[i].scatter_(0, torch.where(match, windows[:, -1], self.vocab_size), True)
        banned = banned[:, :self.vocab_size]
        if columns is not None:
            seen, banned = seen[:, columns], banned[:, columns]
        logits = torch.where(seen, torch.where(logits < 0, logits * self.penalty, logits / self.penalty), logits)
        return logits.masked_fill(banned, float("-inf"))
