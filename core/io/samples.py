"""The bundled sample documents (assets/docs/samples.json) and those of them held out: the level-1 draft is
validated and benchmarked on the held-out ones, never trained on them."""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "assets" / "docs"


def _samples_json() -> dict:
    return json.loads((DOCS / "samples.json").read_text(encoding="utf-8"))


def sample_instructions() -> dict[str, list[str]]:
    """Each sample document's file name -> its suggested instructions."""
    return {s["file"]: s["instructions"] for s in _samples_json()["samples"]}


def held_out_documents() -> list[str]:
    """File names of the held-out sample documents, in samples.json's order."""
    return _samples_json()["held_out"]


def warm_up_text() -> tuple[str, str]:
    """The first 3,000 characters of the first sample document and its first instruction (about 700 tokens)."""
    first = _samples_json()["samples"][0]
    return (DOCS / first["file"]).read_text(encoding="utf-8")[:3000], first["instructions"][0]
