"""The rounds of decoding: a level (a model on a cache), drafters, exact speculative sampling, the autoregressive
baseline and TriForce's hierarchical round loop."""

from __future__ import annotations

from core.decode.levels import Level
from core.decode.graphs import Graphs
from core.decode.sampling import distributions, draw, sample, speculative_verify
from core.decode.repetition import Repetition
from core.decode.round import AUTOREGRESSIVE, DRAFTER_NAMES, Forwards, Hierarchy, Policy, RoundRecord
from core.decode.ahead import Draft, drafts_ahead
from core.decode.triforce import SHADOW_GAMMA, TriForce
from core.decode.compare import difference_note, first_difference
from core.decode.autoregressive import Autoregressive

__all__ = ["Level", "Graphs", "distributions", "draw", "sample", "speculative_verify", "Repetition", "AUTOREGRESSIVE",
           "DRAFTER_NAMES", "Forwards", "Hierarchy", "Policy", "RoundRecord", "Draft", "drafts_ahead", "SHADOW_GAMMA",
           "TriForce", "difference_note", "first_difference", "Autoregressive"]
