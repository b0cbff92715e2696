"""The answer as it grows: incremental detokenisation, stop conditions, provenance."""

from __future__ import annotations

import time

from core.config import GenerationConfig
from core.events import Provenance, Tokens


class Output:
    """Collects emitted tokens, turns them into text pieces, and decides when generation stops."""

    def __init__(self, tokenizer, cfg: GenerationConfig, eos_ids: set[int]):
        self.tokenizer, self.cfg, self.eos_ids = tokenizer, cfg, eos_ids
        self.ids: list[int] = []
        self.provenance: list[Provenance] = []
        self.text = ""
        self._prefix_at = self._read_at = 0  # decode only from a few tokens back: linear, not quadratic, in length
        self.stop_reason = ""
        self.first_token_at: float | None = None

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    def add(self, ids: list[int], provenance: list[Provenance], round_: int) -> Tokens:
        """Append tokens (stopping at EOS, max_new_tokens or a stop string) and return what was emitted."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        event = Tokens([], [], [], round_)
        for tok, prov in zip(ids, provenance):
            if self.done:
                break
            if tok in self.eos_ids:
                self.stop_reason = "eos"
                break
            self.ids.append(tok)
            self.provenance.append(prov)
            piece = self._next_piece()
            event.ids.append(tok)
            event.texts.append(piece)
            event.provenance.append(prov)
            if len(self.ids) >= self.cfg.max_new_tokens:
                self.stop_reason = self.stop_reason or "max_new_tokens"
        return event

    def _next_piece(self) -> str:
        """Text added by the newest token (held back while it ends inside a multi-byte character). Decodes the tokens
        since the last piece together with those before it, so that the tokenizer sees the same context (leading
        spaces, merged bytes) as when decoding the whole answer."""
        before = self.tokenizer.decode(self.ids[self._prefix_at:self._read_at], skip_special_tokens=True)
        now = self.tokenizer.decode(self.ids[self._prefix_at:], skip_special_tokens=True)
        if now.endswith("\ufffd"):
            return ""
        self._prefix_at, self._read_at = self._read_at, len(self.ids)
        piece = now[len(before):]
        full = self.text + piece
        for stop in self.cfg.stop:
            at = full.find(stop, max(0, len(self.text) - len(stop)))
            if stop and at >= 0:
                piece = full[len(self.text):at] if at >= len(self.text) else ""
                self.text = full[:at]
                self.stop_reason = "stop_string"
                return piece
        self.text = full
        return piece
