"""What a command-line run is doing, on stderr: loading (and a GGUF's one-time conversion), the prompt and what its
truncation dropped, prefill, decoding, and the hierarchies method auto chooses. On a terminal prefill and decoding
are bars (tqdm) that vanish when done, prefill's from the moment the prompt is ready; elsewhere (a log, a pipe) each
is a plain line. Also the answer's colours on a terminal and their legend, in core.events' provenance words."""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

from tqdm import tqdm

from core.events import PROVENANCE_LABELS, Event, Finished, Loading, PlanChosen, PrefillProgress, PromptReady, Tokens
from core.io.loading import needs_conversion

PREFILL_LINES = 10  # off a terminal, prefill says how far it is at most this many times
# An answer token's colour on a terminal by its provenance (ANSI code, colour name); autoregressive tokens stay plain.
ANSI_COLOURS = {"draft": ("\033[32m", "green"), "copy": ("\033[36m", "cyan"), "level2": ("\033[33m", "yellow"),
                "level3": ("\033[35m", "magenta")}
LEGEND = "  ".join([*(f"{name}: {PROVENANCE_LABELS[key]}" for key, (_, name) in ANSI_COLOURS.items()),
                    f"plain: {PROVENANCE_LABELS['target']}"])


class Progress:
    """Fed Engine.load's progress (`loading`) and a generation's events (`event`); `quiet` prints nothing."""

    def __init__(self, target: str | None = None, stream: TextIO | None = None, quiet: bool = False):
        self.target, self.quiet = target, quiet
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty()
        self.started = time.monotonic()
        self.label = ""  # the run's name in front of its lines (compare runs two)
        self.bars: dict[str, tqdm] = {}
        self.count_tokens, self.tokens, self.max_new_tokens = True, 0, 0
        self.prefill_lines = 0  # off a terminal: the PREFILL_LINES-ths of the prompt a line has said are done
        self.answer: TextIO | None = None  # where the answer streams, when that is where these lines go too
        self.held: list[str] = []  # lines said while the answer streams there: after it, never inside it

    def say(self, line: str) -> None:
        """One line, above any bar; while the answer streams to the same place, held until it ends."""
        if self.quiet:
            return
        if self.answer is not None and self.tokens:
            self.held.append(line)
            return
        if self.bars:
            tqdm.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def loading(self, event: Loading) -> None:
        """Engine.load's progress callback."""
        if event.stage == "target":
            self.started = time.monotonic()
            converting = needs_conversion(self.target)
            self.say("converting the GGUF into a checkpoint, once (about a minute on a 2-core CPU; later starts load "
                     "in seconds)" if converting else "loading the target model")
        elif event.stage == "draft":
            self.say("loading the level-1 draft model")
        else:
            self.say(f"models ready in {time.monotonic() - self.started:.1f} s")

    def streams_answer(self, answer: TextIO) -> None:
        """The answer streams to `answer`: where that is where these lines go (a terminal, or one log for both), the
        lines said once it has begun (the plans method auto changes to) wait until it ends."""
        try:
            same = os.path.samestat(os.fstat(answer.fileno()), os.fstat(self.stream.fileno()))
        except (AttributeError, OSError, ValueError):  # a stream with no file behind it
            same = answer is self.stream
        self.answer = answer if same else None

    def run(self, label: str, count_tokens: bool = True) -> "Progress":
        """Start a run's lines: `label` in front of them, a decoding bar on a terminal when `count_tokens` (off when
        the answer itself streams to the same terminal)."""
        self.label, self.count_tokens, self.tokens = label, count_tokens, 0
        return self

    def event(self, event: Event) -> None:
        """Report one generation event (most say nothing)."""
        prefix = f"{self.label}: " if self.label else ""
        if isinstance(event, PromptReady):
            self.max_new_tokens = event.max_new_tokens
            self.say(f"{prefix}prompt of {event.prompt_tokens:,} tokens (context {event.context_length:,})")
            if event.dropped_tokens:
                self.say(f"warning: the document is longer than the context ({event.context_length:,} tokens): its "
                         f"middle {event.dropped_tokens:,} tokens were dropped (beginning and end kept; "
                         "--overflow refuse refuses instead)")
            self._bar("prefill", f"{prefix}prefill", event.prompt_tokens, 0)  # at 0 until its first forward reports
            self.prefill_lines = 0
        elif isinstance(event, PrefillProgress):
            self._prefill(prefix, event)
        elif isinstance(event, PlanChosen):
            self.say(f"{prefix}method auto from round {event.round}: {event.plan} ({event.reason})")
        elif isinstance(event, Tokens) and event.ids:
            self.tokens += len(event.ids)
            if self.count_tokens:
                self._bar("decode", f"{prefix}decoding", self.max_new_tokens, self.tokens)
        elif isinstance(event, Finished):
            self._close()
            held, self.held, self.answer = self.held, [], None
            if held:  # below the answer, which ends without a line break
                print("\n" + "\n".join(held), file=self.stream, flush=True)

    def _prefill(self, prefix: str, event: PrefillProgress) -> None:
        if event.reused:
            self.say(f"{prefix}prefill: the previous run's cache already holds this prompt")
        elif self.terminal:
            self._bar("prefill", f"{prefix}prefill", event.total, event.done)
        elif (tenth := event.done * PREFILL_LINES // max(event.total, 1)) > self.prefill_lines:
            self.prefill_lines = tenth  # (a CPU reports every layer: a line for each would flood a log)
            beside = event.decoding_beside  # (--batch) its prompt read between the rounds of those decoding
            self.say(f"{prefix}prefill {event.done:,} / {event.total:,} tokens ({event.seconds:.1f} s)" +
                     (f", between the rounds of {beside} request{'s' if beside > 1 else ''} decoding" if beside else ""))
        if event.done >= event.total:
            self._close()
            if self.count_tokens:  # decoding's clock starts now: a bar made at the first tokens would show a rate
                self._bar("decode", f"{prefix}decoding", self.max_new_tokens, 0)  # of thousands of tokens a second

    def _bar(self, name: str, description: str, total: int | None, done: int) -> None:
        """A bar on a terminal (none elsewhere: the lines say enough), moved to `done`."""
        if self.quiet or not self.terminal:
            return
        if name not in self.bars:
            self.bars[name] = tqdm(total=total, desc=description, unit="tok", leave=False, file=self.stream)
        bar = self.bars[name]
        bar.total = total  # (prefill's counts the prompt but its last token, which decoding feeds)
        bar.update(done - bar.n)

    def _close(self) -> None:
        for bar in self.bars.values():
            bar.refresh()  # its last count (updates closer than tqdm's interval are not drawn), then it vanishes
            bar.close()
        self.bars.clear()
