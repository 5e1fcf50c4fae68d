"""Plotly figures of the page, built from plain arrays so live runs, stored runs and the teaching suite share them.

Large fonts and few colours, because a class may read them off a projector. Each method keeps one colour
everywhere (pane header, lines, bars), so a line is easy to match with its answer. Every figure carries its own
title (the page shows no second label): a short first line, details wrapped below it, so nothing is cut at half a
laptop screen; legends sit right of the plot, clear of the axes. Backgrounds are transparent and the page's CSS
(style.py) recolours text and grid lines in dark mode, so one figure serves both themes.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

METHOD_COLORS = {
    "fp16": "#4C78A8", "kivi-k2v2": "#E45756", "kivi-k2v2*": "#FF9DA6", "kivi-k2v4*": "#B279A2",
    "kivi-k4v2*": "#9D755D", "kivi-k4v4": "#72B7B2", "kitty": "#F58518", "kitty-pro": "#54A24B",
    "kitty-q": "#EECA3B", "kitty-pro-q": "#2F8F6F", "custom": "#7F7F7F",
}
MAX_TOKEN_COLUMNS = 1024         # wider magnitude maps are averaged into this many token bins
FONT = dict(size=14, color="#2a3f5f")
GRID = "rgba(128, 128, 128, 0.25)"       # reads on a light and a dark page alike
TITLE_CHARS = 52                         # a title line that fits half of a 1440 px page at the title's size
DETAIL_CHARS = 68                        # the same for the smaller detail lines


def color(method: str) -> str:
    return METHOD_COLORS.get(method, "#7F7F7F")


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line] if line else lines


def _layout(fig: go.Figure, title: str, height: int = 340, detail: str = "") -> go.Figure:
    """The house style: the title on short lines (its details smaller), transparent backgrounds, the legend right
    of the plot. Panels of a figure are named by their axis titles, not subplot titles, which would crowd it."""
    lines, details = _wrap(title, TITLE_CHARS), _wrap(detail, DETAIL_CHARS)
    fig.update_layout(template="plotly_white", font=FONT, height=height + 20 * (len(lines) + len(details) - 1),
                      # at the top of the figure, in a top margin sized to hold its lines
                      title=dict(text="<br>".join(lines), font=dict(size=16), x=0, xref="paper", xanchor="left",
                                 y=1, yref="container", yanchor="top", pad=dict(t=10),
                                 subtitle=dict(text="<br>".join(details), font=dict(size=12))),
                      paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
                      margin=dict(l=60, r=20, t=30 + 22 * len(lines) + 18 * len(details), b=50),
                      legend=dict(x=1.02, xanchor="left", y=1, yanchor="top", bgcolor="rgba(0,0,0,0)"))
    fig.update_xaxes(gridcolor=GRID, zerolinecolor=GRID, automargin=True)
    fig.update_yaxes(gridcolor=GRID, zerolinecolor=GRID, automargin=True)
    return fig


def empty_figure(title: str, message: str, height: int = 340) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text="<br>".join(_wrap(message, DETAIL_CHARS)), showarrow=False, x=0.5, y=0.5, xref="paper",
                       yref="paper", font=dict(size=15, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height)


def boost_mask_figure(mask: np.ndarray | None, method: str, layer: int, head: int) -> go.Figure:
    """Which key channels of each page were stored at 4 bits: channels x pages, for one layer and KV head."""
    title = f"Boost mask · {method} · layer {layer} · KV head {head}"
    if mask is None or mask.shape[0] == 0:
        return empty_figure(title, "No key page yet: a page forms every 128 tokens after the 32-token sink.")
    z = mask.T.astype(int)                                   # (D, pages)
    pages = np.arange(1, mask.shape[0] + 1)
    fig = go.Figure(go.Heatmap(
        z=z, x=pages, y=np.arange(z.shape[0]), zmin=0, zmax=1, xgap=2,
        colorscale=[[0, "#dde3ea"], [0.5, "#dde3ea"], [0.5, "#F58518"], [1, "#F58518"]],
        colorbar=dict(tickvals=[0.25, 0.75], ticktext=["2-bit", "4-bit"], len=0.6),
        hovertemplate="page %{x}, channel %{y}: %{z}<extra></extra>"))
    fig.update_xaxes(title="key page", dtick=1)
    fig.update_yaxes(title="channel")
    boosted = int(mask[-1].sum())
    return _layout(fig, title, detail=f"{boosted} of {mask.shape[1]} channels boosted per page (orange: 4 bits)")


def magnitude_figure(magnitudes: np.ndarray | None, method: str, layer: int, head: int, *,
                     boundaries: Sequence[int] = (), per_page: bool = False, note: str = "") -> go.Figure:
    """|K| per channel, across tokens (the paper's Figure 2a) or, for stored runs, per page (mean over its
    tokens). `magnitudes` is (tokens or pages, D); `boundaries` are token positions where a page starts."""
    what = "mean |K| per page" if per_page else "|K| per token"
    title = f"Key magnitudes · {method} · layer {layer} · KV head {head}"
    if magnitudes is None or magnitudes.shape[0] == 0:
        return empty_figure(title, note or "No keys yet.")
    z = np.asarray(magnitudes, dtype=np.float32)
    x = np.arange(1, z.shape[0] + 1) if per_page else np.arange(z.shape[0])
    if not per_page and z.shape[0] > MAX_TOKEN_COLUMNS:        # keep the figure light for the browser
        bins = np.array_split(np.arange(z.shape[0]), MAX_TOKEN_COLUMNS)
        x = np.array([b[0] for b in bins])
        z = np.stack([z[b].mean(0) for b in bins])
    fig = go.Figure(go.Heatmap(z=np.round(z.T, 3), x=x, y=np.arange(z.shape[1]), colorscale="Inferno",
                               colorbar=dict(title="|K|", len=0.8),
                               hovertemplate=("page" if per_page else "token") +
                               " %{x}, channel %{y}: %{z}<extra></extra>"))
    for position in boundaries:
        fig.add_vline(x=position - 0.5, line=dict(color="#4fc3f7", width=1, dash="dot"))
    fig.update_xaxes(title="key page" if per_page else "token position", dtick=1 if per_page else None)
    fig.update_yaxes(title="channel")
    return _layout(fig, title, detail=what + (f" · {note}" if note else ""))


def lines_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str, x_title: str,
                 y_title: str, empty: str) -> go.Figure:
    """One line per method, in the method's colour."""
    if not any(len(x) for x, _ in series.values()):
        return empty_figure(title, empty)
    fig = go.Figure()
    for method, (x, y) in series.items():
        fig.add_trace(go.Scatter(x=list(x), y=list(y), mode="lines", name=method,
                                 line=dict(color=color(method), width=3)))
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(title=y_title, rangemode="tozero")
    return _layout(fig, title)


def kv_bytes_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]]) -> go.Figure:
    """KV cache size over time: `series` maps a method to (seconds, bytes)."""
    megabytes = {m: (x, [b / 1e6 for b in y]) for m, (x, y) in series.items()}
    return lines_figure(megabytes, "KV cache size while generating", "seconds since start", "MB",
                        "Sizes appear as tokens arrive.")


def kv_projection_figure(lines: Mapping[str, tuple[Sequence[int], Sequence[int]]],
                         points: Mapping[str, tuple[Sequence[int], Sequence[int]]]) -> go.Figure:
    """KV bytes of one sequence against context length: per method a line from the layout's arithmetic and the
    sizes measured while it generated as markers on it. `lines` / `points` map a method to (tokens, bytes)."""
    title = "KV cache size against context length"
    if not lines:
        return empty_figure(title, "Run a comparison to see this plot.")
    fig = go.Figure()
    for method, (tokens, size) in lines.items():
        fig.add_trace(go.Scatter(x=list(tokens), y=[b / 1e6 for b in size], mode="lines", name=method,
                                 line=dict(color=color(method), width=3), legendgroup=method,
                                 hovertemplate=f"{method}: %{{y:.1f}} MB at %{{x:,}} tokens (projected)<extra></extra>"))
    for method, (tokens, size) in points.items():
        if len(tokens):
            fig.add_trace(go.Scatter(x=list(tokens), y=[b / 1e6 for b in size], mode="markers", showlegend=False,
                                     marker=dict(color=color(method), size=8, line=dict(color="white", width=1)),
                                     legendgroup=method,
                                     hovertemplate=f"{method}: %{{y:.2f}} MB at %{{x:,}} tokens (measured)<extra></extra>"))
    fig.update_xaxes(title="context length (tokens, log scale)", type="log")
    fig.update_yaxes(title="MB (one sequence)", rangemode="tozero")
    return _layout(fig, title, detail="lines: projected from the layout · dots: measured while generating")


def speed_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]]) -> go.Figure:
    """Decode speed over time (rolling over the last few tokens): `series` maps a method to (seconds, tok/s)."""
    return lines_figure(series, "Decode speed (tokens/s, rolling)", "seconds since start", "tokens/s",
                        "Speeds appear as tokens arrive.")


def suite_figure(records: Sequence[Mapping]) -> go.Figure:
    """The teaching suite: KL from FP16, top-1 agreement and perplexity per method, as bars (one panel each)."""
    panels = [("KL vs FP16 (nats/token)", "KL from FP16 ↓"), ("top-1 agreement with FP16", "agreement with FP16 ↑"),
              ("perplexity", "perplexity ↓")]
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.1)
    methods = [r["method"] for r in records]
    for col, (key, name) in enumerate(panels, start=1):
        values = [r[key] for r in records]
        fig.add_trace(go.Bar(x=methods, y=values, marker_color=[color(m) for m in methods],
                             showlegend=False, text=[f"{v:.3g}" for v in values], textposition="outside",
                             cliponaxis=False), row=1, col=col)
        # headroom above the tallest bar for its label, below the panel's title
        fig.update_yaxes(title_text=name, range=[0, 1.25 * max([v for v in values if v == v] or [1]) or 1],
                         row=1, col=col)
    _layout(fig, "Why 2-bit collapses", height=420, detail="quality of each cache on the same text, against FP16")
    fig.update_xaxes(tickangle=-40)
    return fig


def sweep_figure(records: Sequence[Mapping]) -> go.Figure:
    """KL from FP16 against the boosted share of key channels per channel selection (Figure 4, plus query-aware)."""
    fig = go.Figure()
    for selection, colour in (("magnitude", "#F58518"), ("random", "#7F7F7F"), ("query", "#2F8F6F")):
        rows = [r for r in records if r["selection"] == selection]
        if rows:
            fig.add_trace(go.Scatter(x=[100 * r["boost fraction"] for r in rows],
                                     y=[r["KL vs FP16 (nats/token)"] for r in rows], mode="lines+markers",
                                     name=f"{selection} selection", line=dict(color=colour, width=3),
                                     marker=dict(size=10)))
    for share, name in ((12.5, "Kitty"), (25, "Kitty-Pro")):
        fig.add_vline(x=share, line=dict(color="#aaa", dash="dot"), annotation_text=name,
                      annotation_position="top")
    fig.update_xaxes(title="key channels boosted to 4 bits (%)")
    fig.update_yaxes(title="KL from FP16 (nats/token)", rangemode="tozero")
    return _layout(fig, "Boost sweep (paper Figure 4)", height=420,
                   detail="which channels you protect matters: by magnitude, at random or query-aware")


def page_channels_figure(anatomy: Mapping) -> go.Figure:
    """Mean |K| of every key channel on one real page, the channels Kitty boosts to 4 bits in orange."""
    mags = np.asarray(anatomy["magnitudes"])
    boosted = set(anatomy["boosted"])
    fig = go.Figure(go.Bar(x=np.arange(len(mags)), y=mags,
                           marker_color=["#F58518" if c in boosted else "#9aa7b4" for c in range(len(mags))],
                           hovertemplate="channel %{x}: mean |k| %{y:.2f}<extra></extra>"))
    fig.update_xaxes(title="key channel")
    fig.update_yaxes(title="mean |k| over the page's tokens")
    first, last = anatomy["tokens"]
    return _layout(fig, f"One real key page · layer {anatomy['layer']} · KV head {anatomy['head']}", height=360,
                   detail=f"tokens {first}–{last - 1}; orange: the {len(boosted)} channels Kitty stores at 4 bits")


def quantization_figure(anatomy: Mapping) -> go.Figure:
    """The page's loudest and quietest channel token by token: the values, and what 2-bit and 4-bit min/max
    quantization (4 and 16 levels between the channel's min and max) bring back."""
    loud, quiet = anatomy["loud"], anatomy["quiet"]
    # each panel's own title names its channel and errors: axis titles stay short enough for half a page
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=[
        f"{name} channel {ch['channel']}: error {ch['error_two_bit']:.2f} / {ch['error_four_bit']:.2f}"
        for name, ch in (("loud", loud), ("quiet", quiet))])
    fig.update_annotations(font_size=12)
    first = anatomy["tokens"][0]
    for col, ch in enumerate((loud, quiet), start=1):
        tokens = np.arange(first, first + len(ch["values"]))
        for key, label, style in (("values", "keys (16-bit)", dict(color="#7f7f7f", width=2)),
                                  ("two_bit", "2 bits", dict(color="#E45756", width=2, shape="hv")),
                                  ("four_bit", "4 bits", dict(color="#54A24B", width=2, shape="hv"))):
            fig.add_trace(go.Scatter(x=tokens, y=ch[key], mode="lines", line=style, name=label, legendgroup=key,
                                     showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title_text="token position", row=1, col=col)
    fig.update_yaxes(title_text="key value", row=1, col=1)
    return _layout(fig, "What min/max quantization does to one channel", height=440,
                   detail=f"4 levels (2 bits) vs 16 (4 bits); mean |k| {loud['mean_abs']:.1f} vs "
                          f"{quiet['mean_abs']:.2f}; error: mean |k - k^| at 2 / 4 bits")


def passkey_figure(grid: Mapping) -> go.Figure:
    """Pass-key retrieval against prompt length: keys found out of the questions asked, one line per method."""
    fig = go.Figure()
    lengths, asked = grid["lengths"], grid["questions"]
    for method, hits in grid["found"].items():
        fig.add_trace(go.Scatter(x=lengths, y=hits, mode="lines+markers", name=method,
                                 line=dict(color=color(method), width=3), marker=dict(size=10),
                                 hovertemplate=f"{method}: %{{y}} of {asked} keys at %{{x:,}} tokens<extra></extra>"))
    fig.update_xaxes(title="prompt length (tokens)", tickvals=lengths)
    fig.update_yaxes(title=f"keys found (of {asked})", range=[-0.3, asked + 0.3], dtick=1)
    return _layout(fig, "Pass-key retrieval", height=420,
                   detail="a 5-digit number hidden in a story, asked for at the end")
