"""Helpers shared by the benchmark scripts: documents cut to a token count, runs, result files."""

from __future__ import annotations

import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch
import transformers

from core import Engine, GenerationConfig
from core.events import Finished

DOCS = Path(__file__).parent.parent / "assets" / "docs"
RESULTS = Path(__file__).parent / "results"


def document_of(engine: Engine, name: str, tokens: int) -> str:
    """The first `tokens` tokens of a bundled document, as text."""
    ids = engine.tokenizer((DOCS / name).read_text(), add_special_tokens=False)["input_ids"][:tokens]
    return engine.tokenizer.decode(ids)


def finish(engine: Engine, document: str, instruction: str, cfg: GenerationConfig) -> Finished:
    """Run one generation to the end and return its Finished event."""
    for event in engine.generate(document, instruction, cfg):
        if isinstance(event, Finished):
            return event
    raise RuntimeError("no result")


def drafter_settings(spec: str) -> dict:
    """GenerationConfig fields of a drafter spec: "ngram", "model", "model:0.5" (gated at draft confidence 0.5),
    "model+3" (copying the text's continuation after 3-token matches; "model+0": never; "model": the default),
    "model-fusion" (the draft without the target's hidden states), or combinations ("model-fusion+0:0.5")."""
    drafter, _, gate = spec.partition(":")
    drafter, _, lookup = drafter.partition("+")
    drafter, no_fusion, _ = drafter.partition("-fusion")
    return {"drafter": drafter, "draft_confidence": float(gate or 0), "draft_fusion": not no_fusion,
            **({"lookup_min": int(lookup)} if lookup else {})}


def environment() -> dict:
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "-m", "bench." + Path(sys.argv[0]).stem, *sys.argv[1:]]),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(),
            "cpu_threads": torch.get_num_threads()}


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{dt.date.today().isoformat()}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
