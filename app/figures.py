"""Plotly figures: the retrieval heatmap (chunk × step or chunk × layer), the Compare bar chart, the cost per
level. They are redrawn several times a second while a run streams, in the process that decodes, so each is
written as plotly's figure JSON and wrapped without validation (plotly validating a figure and copying its template
cost 25-50 ms a figure; this takes under 1 ms); subplot grids come from make_subplots, once per shape."""

from __future__ import annotations

import copy
import functools
import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from app.state import RunState, bin_max, compact_dtype
from app.views import plural

MAX_ROWS = 96  # decoding steps shown: about what the heatmap's height shows; the download has every selection
HEATMAP_MODES = ("auto", "per decoding step", "per layer")
SNIPPET_CHARS = 40


@functools.cache
def _template() -> dict:
    """The plotly_white template as figure JSON, read once."""
    return pio.templates["plotly_white"].to_plotly_json()


def _grid(titles: tuple[str, ...], shared_yaxes: bool = False, spacing: float | None = None) -> dict:
    """The layout of a one-row subplot grid with these titles (axes domains, title annotations): a copy the caller
    may change, of one made once per shape."""
    return copy.deepcopy(_grid_once(titles, shared_yaxes, spacing))


@functools.cache
def _grid_once(titles: tuple[str, ...], shared_yaxes: bool, spacing: float | None) -> dict:
    """make_subplots' layout of a one-row grid, without its template (never changed: _grid hands out copies)."""
    layout = make_subplots(rows=1, cols=len(titles), subplot_titles=titles, shared_yaxes=shared_yaxes,
                           horizontal_spacing=spacing).layout.to_plotly_json()
    layout.pop("template", None)
    return layout


def _axes(col: int) -> dict:
    """A trace's axes in column `col` (1-based) of a grid."""
    return {"xaxis": "x" if col == 1 else f"x{col}", "yaxis": "y" if col == 1 else f"y{col}"}


def _figure(data: list[dict], title: str, height: int = 360, layout: dict | None = None) -> go.Figure:
    """A figure from trace dicts and layout entries, in the shared compact look, unvalidated (see the module note)."""
    layout = {**(layout or {}), "title": {"text": title, "font": {"size": 14}}, "template": _template(),
              "height": height, "margin": {"l": 60, "r": 20, "t": 64 if "<br>" in title else 40, "b": 40}}
    return go.Figure({"data": data, "layout": layout}, _validate=False)


def short(value: float) -> str:
    """A number in at most three significant digits, without an exponent below a million."""
    return f"{value:,.0f}" if 1000 <= abs(value) < 1e6 else f"{value:.3g}"


def empty_figure(message: str, height: int = 360) -> go.Figure:
    """A blank figure carrying a centred message."""
    return _figure([], "", height, {"annotations": [{"text": message, "showarrow": False, "x": 0.5, "y": 0.5,
                                                    "xref": "paper", "yref": "paper"}],
                                   "xaxis": {"visible": False}, "yaxis": {"visible": False}})


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


def count_step(top: int, ticks: int = 6) -> int:
    """A tick step for an axis of counts 0..top: the least of 1, 2, 5, 10, 20, ... giving at most `ticks` steps (whole
    numbers only: a count is never 0.5)."""
    return next(step for step in (m * 10**e for e in range(19) for m in (1, 2, 5)) if top <= ticks * step)


def pick_rows(n: int, max_rows: int = MAX_ROWS) -> np.ndarray:
    """Indices of at most max_rows evenly spaced rows out of n, always including the last one."""
    if n <= max_rows:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_rows).round().astype(np.int64))


def _heatmap(z: np.ndarray, labels: list[str], y: list, y_title: str, zmax: int, title: str,
             hover_what: str) -> go.Figure:
    """A chunk heatmap with token-position ticks on x."""
    heatmap = {"type": "heatmap", "z": z, "x": labels, "y": y, "zmin": 0, "zmax": max(zmax, 1),
               "colorscale": "Viridis", "colorbar": {"title": {"text": hover_what, "side": "right"}, "thickness": 12,
                                                     "tick0": 0, "dtick": count_step(zmax), "tickformat": "d"},
               "hovertemplate": "%{x}<br>" + y_title + " %{y}<br>" + hover_what + ": %{z}<extra></extra>"}
    step = max(1, len(labels) // 8)
    ticks = [lab.split(" · ")[1].split("–")[0].replace("tokens ", "tok ") for lab in labels[::step]]
    return _figure([heatmap], title, 380, layout={
        "xaxis": {"type": "category", "tickmode": "array", "tickvals": labels[::step], "ticktext": ticks,
                  "title": {"text": "document position"}},
        "yaxis": {"title": {"text": y_title}, "type": "category",
                  "autorange": "reversed" if y_title == "layer" else True}})


def heatmap_view(state: RunState, mode: str = HEATMAP_MODES[0]) -> str:
    """The view a mode shows: auto picks the per-layer view while every selection so far is the same one (rows
    per decoding step would all be equal), the per-step view once re-selection makes them differ."""
    if mode != "auto":
        return mode
    distinct = len(state.kept_selections) + state.selections_not_kept
    return HEATMAP_MODES[1] if distinct > 1 else HEATMAP_MODES[2]


def selection_heatmap(state: RunState, mode: str = HEATMAP_MODES[0]) -> go.Figure:
    """Which prompt chunks the retrieval cache keeps, per decoding step or per layer of the latest selection; the
    title says which view it is and why."""
    if state.layer_counts is None or state.edges is None:
        message = ("Autoregressive decoding reads the full cache: no retrieval to show." if state.method == "ar"
                   else "The retrieval heatmap appears after prefill.")
        return empty_figure(message)
    labels = column_labels(state)
    cache = f"{state.num_chunks:,} chunks of {state.chunk_size} tokens, budget {state.budget:,} tokens"
    selections = len(state.selection_rounds)
    if heatmap_view(state, mode) == HEATMAP_MODES[2]:
        z = bin_max(state.layer_counts, state.edges)
        why = ("the answer's one selection, kept at every decoding step" if selections == 1
               else f"the selection of round {state.selection_rounds[-1]}")
        title = f"Per layer: {why}<br><sup>KV heads keeping each chunk · {cache}</sup>"
        return _heatmap(z, labels, list(range(z.shape[0])), "layer", state.heads_per_layer, title, "KV heads")
    if state.step_selection and selections > 1:
        rows = pick_rows(len(state.step_selection))
        z = np.stack([state.selection_columns[max(state.step_selection[i], 0)] for i in rows])
        y = [state.step_rounds[i] for i in rows]
        what = plural(selections, "selection")
    else:  # one selection stands for every step: one row, not as many identical ones as steps
        z, y = state.selection_columns[-1][None, :], [state.selection_rounds[-1]]
        what = "one selection, kept at every decoding step" if state.step_selection else plural(selections,
                                                                                                "selection")
    z = z.astype(compact_dtype(state.max_count), copy=False)
    title = f"Per decoding step: {what}<br><sup>layer×heads keeping each chunk · {cache}</sup>"
    return _heatmap(z, labels, y, "decoding step", state.max_count, title, "layer×heads")


RUN_COLOURS = {"ar": "#9ca3af", "triforce": "#2563eb", "auto": "#7c3aed"}  # a Compare run's bars, by method


def compare_bars(runs: Sequence[tuple[str, str, dict | None]]) -> go.Figure:
    """Bars of decode speed (tokens/s, ms per token) apart from prefill and time to first token, one bar per run
    (method, the label saying what ran, its stats), titled with the device and dtype they ran on."""
    metrics = (("decode: tokens/s", "tokens_per_s", 1.0), ("decode: ms per token", "tokens_per_s", None),
               ("prefill (s)", "prefill_s", 1.0), ("time to first token (s)", "time_to_first_token_s", 1.0))
    data = []
    for method, name, stats in runs:
        stats = stats or {}
        values = []
        for _, key, scale in metrics:
            raw = stats.get(key)
            if raw is None or raw == 0:
                values.append(None)
            else:
                values.append(raw * scale if scale is not None else 1000.0 / raw)
        for col, value in enumerate(values, start=1):
            reused = col == 3 and stats.get("prefill_reused")
            text = "" if value is None else short(value) + (" (cache reused)" if reused else "")
            data.append({"type": "bar", "x": [name], "y": [value], "name": name,
                         "marker": {"color": RUN_COLOURS.get(method, "#64748b")}, "showlegend": col == 1,
                         "text": [text], "textposition": "auto", **_axes(col)})
    ran_on = next((stats for _, _, stats in runs if stats and stats.get("device")), {})
    device = " · ".join(v for v in (ran_on.get("device"), ran_on.get("dtype")) if v)
    layout = _grid(tuple(m[0] for m in metrics))
    for name in [key for key in layout if key.startswith("xaxis")]:
        layout[name] |= {"showticklabels": False}  # the legend names the bars
    return _figure(data, "Same input and seed" + (f", on {device}" if device else ""), 320, layout)


LEVEL_COLORS = {"level1": "#22c55e", "level2": "#f59e0b", "level3": "#ef4444", "selection": "#a78bfa",
                "target": "#9ca3af"}


COSTS_PENDING = "The cost of each level appears when the run has finished."
COSTS_STOPPED = "Stopped before the end: the cost of each level is measured over a finished run."


def cost_figure(rows: Sequence[dict], tokens_per_forward: float | None, reference: Sequence[dict] = (),
                empty: str = COSTS_PENDING) -> go.Figure:
    """The finished run's cost per level: milliseconds and MiB read (weights + KV cache) per step, and each level's
    share of the decode time; `reference` rows (autoregressive) join the first two panels; `empty` says why none."""
    if not rows:
        return empty_figure(empty, height=160)
    layout = _grid(("ms / step", "MiB read / step", "% of decode time"), True, 0.07)
    data = []
    every = [*rows, *reference]
    labels = [row["level"] for row in every]
    columns = (("ms_per_step", 1.0, " ms", every), ("bytes_per_step", 1 / 2**20, " MiB", every),
               ("share", 100.0, " %", rows))
    for col, (key, scale, unit, shown) in enumerate(columns, start=1):
        values = [None if row[key] is None else row[key] * scale for row in shown]
        data.append({
            "type": "bar", "y": labels[:len(shown)], "x": values, "orientation": "h", "showlegend": False,
            "marker": {"color": [LEVEL_COLORS.get(row["key"], "#64748b") for row in shown]},
            "text": ["" if v is None else short(v) + unit for v in values], "textposition": "auto",
            "customdata": [[row["steps"], row["ms"]] for row in shown],
            "hovertemplate": "%{y}<br>%{customdata[0]} steps, %{customdata[1]:.1f} ms in all (bytes read: the "
                             "weights of one forward + the level's KV cache)<extra></extra>", **_axes(col)})
    for name in [key for key in layout if key.startswith("yaxis")]:
        layout[name] |= {"autorange": "reversed", "categoryorder": "array", "categoryarray": labels}
    for annotation in layout["annotations"]:
        annotation["font"] = {"size": 12}
    per_forward = f" · {tokens_per_forward:.2f} tokens per target forward" if tokens_per_forward else ""
    return _figure(data, f"Cost per level of the last run{per_forward}", 120 + 40 * len(labels), layout)
