"""Method auto: which levels draft and how far, chosen round by round from a cost model and what runs measured."""

from __future__ import annotations

from core.plan.cost import Drafter, Figures, Line, best, candidates, expected_tokens, rate
from core.plan.estimate import CostBook, Estimate, Estimates, Regime, prior
from core.plan.policy import Auto, Fixed

__all__ = ["Drafter", "Figures", "Line", "best", "candidates", "expected_tokens", "rate", "CostBook", "Estimate",
           "Estimates", "Regime", "prior", "Auto", "Fixed"]
