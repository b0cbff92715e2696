"""Plotly figures: the retrieval heatmap (chunk × step or chunk × layer), the Compare bar chart, the cost per
level."""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.state import RunState, bin_max, compact_dtype

MAX_ROWS = 256
HEATMAP_MODES = ("chunk × decoding step", "chunk × layer (current selection)")
SNIPPET_CHARS = 60


def _layout(fig: go.Figure, title: str, height: int = 360) -> go.Figure:
    """Shared compact look."""
    fig.update_layout(title={"text": title, "font": {"size": 14}}, template="plotly_white", height=height,
                      margin={"l": 60, "r": 20, "t": 40, "b": 40})
    return fig


def short(value: float) -> str:
    """A number in at most three significant digits, without an exponent below a million."""
    return f"{value:,.0f}" if 1000 <= abs(value) < 1e6 else f"{value:.3g}"


def empty_figure(message: str) -> go.Figure:
    """A blank figure carrying a centred message."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, "")


def column_labels(state: RunState) -> list[str]:
    """Hover label of each heatmap column: chunk range, token range and a text snippet (unique per column; escaped,
    as Plotly renders markup in hover text)."""
    edges, cs = state.edges, max(state.chunk_size, 1)
    labels = []
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        first, last = a * cs, min(b * cs, state.prompt_tokens or b * cs) - 1
        snippet = html.escape(" ".join("".join(state.chunk_texts[a:min(b, a + 16)]).split())[:SNIPPET_CHARS])
        chunks = f"chunk {a}" if b - a == 1 else f"chunks {a}–{b - 1}"
        labels.append(f"{chunks} · tokens {first}–{last} · “{snippet}”")
    return labels


def pick_rows(n: int, max_rows: int = MAX_ROWS) -> np.ndarray:
    """Indices of at most max_rows evenly spaced rows out of n, always including the last one."""
    if n <= max_rows:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_rows).round().astype(np.int64))


def _heatmap(z: np.ndarray, labels: list[str], y: list, y_title: str, zmax: int, title: str,
             hover_what: str) -> go.Figure:
    """A chunk heatmap with token-position ticks on x."""
    fig = go.Figure(go.Heatmap(
        z=z, x=labels, y=y, zmin=0, zmax=max(zmax, 1), colorscale="Viridis",
        colorbar={"title": {"text": hover_what, "side": "right"}, "thickness": 12},
        hovertemplate="%{x}<br>" + y_title + " %{y}<br>" + hover_what + ": %{z}<extra></extra>"))
    step = max(1, len(labels) // 8)
    fig.update_xaxes(type="category", tickmode="array", tickvals=labels[::step],
                     ticktext=[lab.split(" · ")[1].split("–")[0].replace("tokens ", "tok ") for lab in labels[::step]],
                     title="document position")
    fig.update_yaxes(title=y_title, type="category", autorange="reversed" if y_title == "layer" else True)
    return _layout(fig, title)


def selection_heatmap(state: RunState, mode: str = HEATMAP_MODES[0]) -> go.Figure:
    """Which prompt chunks the retrieval cache keeps, per decoding step or per layer of the latest selection."""
    if state.layer_counts is None or state.edges is None:
        message = ("Autoregressive decoding reads the full cache: no retrieval to show." if state.method == "ar"
                   else "The retrieval heatmap appears after prefill.")
        return empty_figure(message)
    labels = column_labels(state)
    if mode == HEATMAP_MODES[1]:
        z = bin_max(state.layer_counts, state.edges)
        title = f"Selection of round {state.selection_rounds[-1]}: KV heads keeping each chunk, per layer"
        return _heatmap(z, labels, list(range(z.shape[0])), "layer", state.heads_per_layer, title, "KV heads")
    if state.step_selection:
        rows = pick_rows(len(state.step_selection))
        z = np.stack([state.selection_columns[max(state.step_selection[i], 0)] for i in rows])
        y = [state.step_rounds[i] for i in rows]
    else:
        z, y = state.selection_columns[-1][None, :], [state.selection_rounds[-1]]
    z = z.astype(compact_dtype(state.max_count), copy=False)
    title = (f"Retrieval cache: {state.num_chunks} chunks of {state.chunk_size} tokens, budget {state.budget} tokens, "
             f"{len(state.selection_rounds)} selection(s)")
    return _heatmap(z, labels, y, "decoding step", state.max_count, title, "layer×heads")


def compare_bars(ar: dict | None, tf: dict | None) -> go.Figure:
    """Bars of decode speed (tokens/s, ms per token) apart from prefill and time to first token, autoregressive vs
    TriForce, titled with the device and dtype they ran on."""
    metrics = (("decode: tokens/s", "tokens_per_s", 1.0), ("decode: ms per token", "tokens_per_s", None),
               ("prefill (s)", "prefill_s", 1.0), ("time to first token (s)", "time_to_first_token_s", 1.0))
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[m[0] for m in metrics])
    for name, stats, colour in (("autoregressive", ar, "#9ca3af"), ("TriForce", tf, "#2563eb")):
        values = []
        for _, key, scale in metrics:
            raw = (stats or {}).get(key)
            if raw is None or raw == 0:
                values.append(None)
            else:
                values.append(raw * scale if scale is not None else 1000.0 / raw)
        for col, value in enumerate(values, start=1):
            reused = col == 3 and (stats or {}).get("prefill_reused")
            text = "" if value is None else short(value) + (" (cache reused)" if reused else "")
            fig.add_trace(go.Bar(x=[name], y=[value], name=name, marker_color=colour, showlegend=col == 1,
                                 text=[text], textposition="auto"), row=1, col=col)
    device = " · ".join(v for v in ((tf or {}).get("device"), (tf or {}).get("dtype")) if v)
    return _layout(fig, "Autoregressive vs TriForce (same input and seed" + (f", on {device})" if device else ")"),
                   height=320)


LEVEL_COLORS = {"level1": "#22c55e", "level2": "#f59e0b", "level3": "#ef4444", "selection": "#a78bfa",
                "target": "#9ca3af"}


def cost_figure(rows: Sequence[dict], tokens_per_forward: float | None, reference: Sequence[dict] = ()) -> go.Figure:
    """The finished run's cost per level: milliseconds and MiB read (weights + KV cache) per step, and each level's
    share of the decode time; `reference` rows (autoregressive) join the first two panels."""
    if not rows:
        return empty_figure("The cost of each level appears when the run has finished.").update_layout(height=160)
    panels = ("ms / step", "MiB read / step", "% of decode time")
    fig = make_subplots(rows=1, cols=3, shared_yaxes=True, subplot_titles=panels, horizontal_spacing=0.07)
    every = [*rows, *reference]
    labels = [row["level"] for row in every]
    columns = (("ms_per_step", 1.0, " ms", every), ("bytes_per_step", 1 / 2**20, " MiB", every),
               ("share", 100.0, " %", rows))
    for col, (key, scale, unit, shown) in enumerate(columns, start=1):
        values = [None if row[key] is None else row[key] * scale for row in shown]
        fig.add_trace(go.Bar(
            y=labels[:len(shown)], x=values, orientation="h", showlegend=False,
            marker_color=[LEVEL_COLORS.get(row["key"], "#64748b") for row in shown],
            text=["" if v is None else short(v) + unit for v in values], textposition="auto",
            customdata=[[row["steps"], row["ms"]] for row in shown],
            hovertemplate="%{y}<br>%{customdata[0]} steps, %{customdata[1]:.1f} ms in all (bytes read: the weights "
                          "of one forward + the level's KV cache)<extra></extra>"),
            row=1, col=col)
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=labels)
    per_forward = f" · {tokens_per_forward:.2f} tokens per target forward" if tokens_per_forward else ""
    fig.update_annotations(font_size=12)
    return _layout(fig, f"Cost per level of the last run{per_forward}", height=120 + 40 * len(labels))
