"""Text of the "How it works" tab and the table of loaded models, devices and versions."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import gradio as gr

from app.views import PROVENANCE, REJECTED
from core.batching import DEVICE_SHARE_BESIDE_DECODING, PACE_BESIDE_PREFILL
from core.config import SEATS

# What a CPU visitor should expect, and why: said up front and beside Compare's figures.
CPU_NOTE = ("On a CPU, expect TriForce near plain decoding's speed, a little faster greedy and slower sampled: a 135M "
            "model's step mostly reads its weights, which a small cache does not spare. TriForce pays where the KV "
            "cache dominates a step: large models, long documents, GPUs, an offloaded cache.")

EXPLANATION = f"""
## TriForce in three levels
At long context the **KV cache**, not the weights, dominates the memory traffic of each decoding step. Attention is
sparse, and the set of useful cache entries changes slowly, so the target model reading only a small, well-chosen
part of its own cache is a cheap and very accurate draft. TriForce stacks three models
([Sun et al., 2024, arXiv 2404.11912](https://arxiv.org/abs/2404.11912)):

1. **Level 1: tiny drafter.** A small model (or an n-gram lookup in the prompt) with a StreamingLLM cache
   (attention-sink tokens plus a recent window) proposes γ1 tokens at a time; where the text's last few tokens
   occurred earlier in the document, the model drafter copies what followed them (it cannot see that far back).
   The embedded draft also reads the target's hidden state that produced the last token (computed by level 2 or
   3, which read the document), mixed into its own before its head.
2. **Level 2: target + retrieval cache.** The target model attends only to a *budget* of cache entries: the prompt
   is cut into chunks, each chunk is summarised by its mean key, and per layer and KV head the chunks whose mean
   key best matches the current query are kept (chunk 0, the attention sink, always). It verifies level-1 tokens
   by speculative sampling until it has γ2 tokens.
3. **Level 3: target + full cache.** One forward pass over the γ2 tokens verifies them against the full cache; the
   accepted tokens are emitted plus one correction (after a rejection) or bonus token.

Speculative sampling accepts a draft token x with probability min(1, p(x)/q(x)) and otherwise samples from the
residual max(p − q, 0), so the output follows the target's distribution exactly; with greedy decoding it is
token-identical to plain autoregressive decoding (the *Compare* tab checks this).

## When the KV cache does not fit the GPU
A 7B model at 128K tokens holds about 64 GB of keys and values: more than a 24 GB card. Then (setting *Offload the
full KV cache*: auto) the full cache lives in CPU memory and each full-cache forward streams it to the GPU one layer
at a time, copying the next layer while the current one computes; weights, the retrieval cache and the draft stay on
the GPU. A full-cache step then costs the cache's bytes over the CPU–GPU link (about 1.3 s for that 7B at 55 GB/s),
which is exactly the step TriForce takes rarely: level 3 checks γ2 tokens per pass, while levels 1 and 2 read only
GPU memory. This is the regime of the paper's largest speedups (4.9–7.8× on RTX 4090s). The status line says where
each cache lives, and the stats give the bytes moved over the link per token.

## Several visitors at once
Off a ZeroGPU Space this app decodes every visitor's run in one batch, up to {SEATS} at once: each round level 2
drafts for every run (checking each run's level-1 proposals), then one level-3 forward verifies all their drafts,
its projections reading the weights once for every row while each row attends over its own run's caches, so a greedy
answer is the one the run alone gives. A run that arrives while the batch decodes joins it at a next round (prompts
are read one at a time, between rounds, on a share of the rounds' time: a run decoding meanwhile keeps about
{PACE_BESIDE_PREFILL:.0%} of its pace, the arriving prompt is read in about {DEVICE_SHARE_BESIDE_DECODING:.0%} of the time, and
both statuses say so); beyond the seats runs wait in line, first come first served, each told its place, and *Stop* ends only your own. In the batch every cache stays on the device and method *auto* plans one draft
length for all its runs (level 2 drafting alone); a run goes at the batch's pace, so *Compare* says of each run
whether it had the device to itself. On ZeroGPU, which lends its GPU to one request at a time, runs go one at a
time.

## What the visuals show
- **Answer:** plain text. *Colour by provenance* shows where each token came from: *{PROVENANCE['draft'][0]}*
  (proposed by level 1 and kept by both checks), *{PROVENANCE['copy'][0]}* (the same for a token level 1 copied from
  earlier in the text), *{PROVENANCE['level2'][0]}* (sampled by level 2, kept by level 3),
  *{PROVENANCE['level3'][0]}* and *{PROVENANCE['target'][0]}* (a step that drafted nothing: plain decoding, or method
  auto's autoregressive plan). The more green, the fewer expensive full-cache passes per token. *Show rejected
  drafts* adds, struck through where they were tried, the drafts a level turned down: *{REJECTED[(1, 2)][0]}* (with
  the proposals after it), *{REJECTED[(2, 3)][0]}* (level-2 tokens the full cache turned down) and, when the planner
  leaves level 2 out, *{REJECTED[(1, 3)][0]}*.
- **Method auto:** TriForce pays only where reading the full KV cache is what a step costs. With method *auto* a
  planner measures each level's step and the acceptance so far, and picks each round's hierarchy — autoregressive,
  level 1 → 3, level 2 → 3 or 1 → 2 → 3 — and its γs; the status line and *Compare* say what it chose and why, the
  timeline marks each change. Every hierarchy verifies exactly, so the plan changes the speed, never the output.
  *triforce* always runs levels 1 → 2 → 3.
- **Speculation timeline:** one block per level-3 round. Its top row is level 3's verdict on the drafted tokens
  (kept, the rejected one, the discarded rest, then level 3's own token); the bottom row is each level-2 step's
  verdict on the level-1 tokens, then level 2's own token. Hover a block for the counts; stretches of
  autoregressive steps are counted (*AR*) and ▸ marks a plan the planner chose (hover it for why).
- **Retrieval heatmap:** x is the position in the document (chunks, grouped into at most 384 columns, each column
  showing its most-kept chunk); colour counts how many (layer, KV head) pairs keep the chunk; hover for the token
  range and a snippet of the text. *auto* shows what carries information: the per-layer view of the selection while
  there is one (with re-selection *once*, every decoding step keeps the same chunks), the per-decoding-step view
  once re-selection makes the rows differ; the title says which. The *Raw stats* download has every selection at
  full resolution.
- **Kept spans:** the most-kept chunks of the latest selection, in document order, with the skipped stretches
  summarised.
- **Cost per level** (after a run): milliseconds and bytes read per step at each level (the weights a forward reads
  plus that level's KV cache: the draft's StreamingLLM cache, the retrieval cache, the full cache), each level's
  share of the decode time (chunk selection apart), and the tokens each full-cache forward yields. TriForce pays off
  when the cheap levels' steps cost little next to a full-cache step and most of their tokens are kept.
- **Stats:** decode tokens/s and ms/token, time to first token (includes prefill), prefill time, acceptance of
  level-1 drafts and of level-2 tokens (by level 3), mean tokens per full-cache forward, budget as a share of the
  prompt, the memory of the full and the retrieval KV cache, and the device and dtype; — where a figure does not
  apply (autoregressive decoding drafts nothing).
"""


ROOT = Path(__file__).resolve().parent.parent  # this checkout: where the package `core` lives


def literal(text: str) -> str:
    """A Python string literal of `text`, in double quotes (JSON's escapes are Python's)."""
    return json.dumps(text, ensure_ascii=False)


def python_snippet(document: Path, question: str) -> str:
    """Markdown: a script that asks `question` of `document` through the engine, runnable from a file saved anywhere
    (it puts this checkout on Python's path) with the Python that runs this app."""
    code = f"""import sys

sys.path.insert(0, {literal(str(ROOT))})  # this checkout of TriForce Studio, where the package `core` lives

from core import Engine
from core.events import Finished, Tokens

engine = Engine.load()  # the embedded SmolLM2-135M-Instruct; or a preset id, e.g. Engine.load("qwen2.5-coder-1.5b")
document = open({literal(str(document))}, encoding="utf-8").read()
settings = engine.settings(method="triforce", greedy=True)  # the preset's settings, these on top
for event in engine.generate(document, {literal(question)}, settings):
    if isinstance(event, Tokens):
        print("".join(event.texts), end="", flush=True)
    elif isinstance(event, Finished):
        print(f"\\n{{event.stats.new_tokens}} tokens, {{event.stats.tokens_per_s:.1f}} tokens/s")"""
    return (f"## From Python\nSave this anywhere as a `.py` file and run it with the Python that runs this app "
            f"(`{sys.executable}`):\n\n```python\n{code}\n```")


def engine_table(infos: list[dict]) -> str:
    """Markdown table of every loaded engine's models, device, dtype, context and library versions."""
    if not infos:
        return "No model loaded yet: run a generation first."
    blocks = []
    for info in infos:
        rows = [("target", info.get("target")), ("draft", info.get("draft") or "none"),
                ("device", info.get("device")), ("dtype", info.get("dtype")),
                ("context length", f"{info.get('context_length', 0):,}")]
        rows += [(name, version) for name, version in (info.get("versions") or {}).items()]
        # the target heads its table: a Markdown table needs a header row, and an empty one shows as a blank bar
        (head, model), *rest = rows
        blocks.append(f"| {head} | {model} |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rest))
    blocks.append(f"Gradio {gr.__version__} · Python {platform.python_version()}")
    return "\n\n".join(blocks)
