"""Plotly figures of the study records (what the CLI writes as HTML and the Insights tab shows). Built from the
JSON-ready record alone, so a shipped record draws the same figure as a live run. Large fonts, as in app/plots.py
(a class may read them off a projector); every axis says what it measures and in which unit."""
from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

SELECTION_COLORS = {"magnitude": "#F58518", "random": "#7F7F7F", "query": "#54A24B"}
FONT = dict(size=15)


def _layout(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(template="plotly_white", title=dict(text=title, font=dict(size=16)), font=FONT, height=height,
                      margin=dict(l=70, r=20, t=70, b=60), legend=dict(orientation="h", y=-0.2))
    return fig


def _subtitle(result: Mapping) -> str:
    return f"{result['model']} · {result['settings'].get('text tokens', '?')} tokens"


def selection_figure(result: Mapping) -> go.Figure:
    """KL from FP16 and perplexity / FP16 against the share of boosted channels, one line per selection."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["KL from FP16 ↓", "perplexity / FP16 ↓"],
                        horizontal_spacing=0.12)
    rows = result["rows"][1:]
    for selection in dict.fromkeys(r[0] for r in rows):
        line = sorted((r for r in rows if r[0] == selection), key=lambda r: r[1])
        for col, index in ((1, 3), (2, 5)):
            fig.add_trace(go.Scatter(x=[100 * r[1] for r in line], y=[r[index] for r in line], mode="lines+markers",
                                     name=f"{selection} selection", legendgroup=selection, showlegend=col == 1,
                                     line=dict(color=SELECTION_COLORS.get(selection, "#4C78A8"), width=3),
                                     marker=dict(size=10)), row=1, col=col)
    fig.update_xaxes(title="key channels boosted to 4 bits (%)")
    fig.update_yaxes(title="KL (nats/token)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="perplexity / FP16 perplexity (ratio)", row=1, col=2)
    return _layout(fig, f"Channel selection: same memory, which channels to protect · {_subtitle(result)}")


def channels_figure(result: Mapping, layer: int | None = None, head: int = 0) -> go.Figure:
    """One layer and KV head: the attention error of each channel alone at 2 bits (one line per query head of the
    group, log scale), the mean |k| and the query-aware score per channel, with their rank correlations."""
    layer = str(layer if layer is not None else result["settings"]["layers"][0])
    data = result["layers"][layer][head]
    channels = list(range(len(data["magnitude"])))
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=[
        "attention-weight MSE with only this channel at 2 bits",
        f"mean |k| (Kitty's ranking) · Spearman with the error {data['rho_magnitude']:.2f}",
        f"E[q²] × 2-bit error (query-aware ranking) · Spearman {data['rho_query']:.2f}"])
    for i, mse in enumerate(data["mse"]):
        fig.add_trace(go.Scatter(x=channels, y=mse, mode="lines+markers", name=f"query head {i} of the group",
                                 marker=dict(size=5)), row=1, col=1)
    fig.add_trace(go.Bar(x=channels, y=data["magnitude"], marker_color="#F58518", name="mean |k|"), row=2, col=1)
    fig.add_trace(go.Bar(x=channels, y=data["query_score"], marker_color="#54A24B", name="E[q²] × 2-bit error"),
                  row=3, col=1)
    fig.update_yaxes(title="MSE (squared weight)", type="log", row=1, col=1)
    fig.update_yaxes(title="|k| (key units)", row=2, col=1)
    fig.update_yaxes(title="score (q² · k² units)", row=3, col=1)
    fig.update_xaxes(title="key channel", row=3, col=1)
    return _layout(fig, f"Figure 2b · layer {layer} · KV head {head} · {_subtitle(result)}", height=720)


def masks_figure(result: Mapping) -> go.Figure:
    """Jaccard index of the boosted sets per layer: with the previous page and with the first page."""
    fig = go.Figure()
    for selection, data in result["jaccard"].items():
        colour = SELECTION_COLORS.get(selection, "#4C78A8")
        fig.add_trace(go.Scatter(x=data["layers"], y=data["previous"], mode="lines+markers",
                                 line=dict(color=colour, width=3), name=f"{selection}: with the previous page"))
        fig.add_trace(go.Scatter(x=data["layers"], y=data["first"], mode="lines+markers",
                                 line=dict(color=colour, width=2, dash="dot"),
                                 name=f"{selection}: with the first page"))
    chance = result.get("random_jaccard")
    if chance == chance and chance is not None:                               # NaN: no boost, no baseline
        fig.add_hline(y=chance, line=dict(color="#aaa", dash="dash"), annotation_text="two random sets",
                      annotation_position="bottom right")
    fig.update_xaxes(title="layer")
    fig.update_yaxes(title="Jaccard index (1 = same channels)", range=[0, 1.05])
    return _layout(fig, f"How much the boosted set changes from page to page · {_subtitle(result)}")


def layers_figure(result: Mapping) -> go.Figure:
    """KL with only one layer at 2 bits (bars) and the boosted channels each allocation gives each layer."""
    sens = result["sensitivity"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, subplot_titles=[
        "KL from FP16 with only this layer at 2 bits", "boosted key channels per layer (same total)"])
    fig.add_trace(go.Bar(x=sens["layers"], y=sens["kl"], marker_color="#E45756", name="one layer at 2 bits"),
                  row=1, col=1)
    for (name, counts), colour in zip(result["allocations"].items(), ("#7F7F7F", "#54A24B", "#4C78A8")):
        fig.add_trace(go.Scatter(x=sens["layers"], y=counts, mode="lines+markers", name=name,
                                 line=dict(color=colour, width=3)), row=2, col=1)
    fig.update_yaxes(title="KL (nats/token)", row=1, col=1)
    fig.update_yaxes(title="channels", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title="layer", row=2, col=1)
    return _layout(fig, f"Per-layer sensitivity and a layer-wise boost budget · {_subtitle(result)}", height=640)


def pareto_figure(result: Mapping) -> go.Figure:
    """KL against bits per element for every setting, at the text's length and at the long length; frontier lines
    and the paper's defaults marked."""
    long_tokens = result["settings"]["long length"]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=[
        f"at {result['settings']['text tokens']} tokens (measured)", f"at {long_tokens} tokens (bits by arithmetic)"])
    rows = result["rows"]
    for col, bits, flag in ((1, 4, 8), (2, 5, 9)):
        labels = [f"S{r[0]} R{r[1]} G{r[2]} α{r[3]:g}" for r in rows]
        fig.add_trace(go.Scatter(x=[r[bits] for r in rows], y=[r[6] for r in rows], mode="markers", text=labels,
                                 marker=dict(size=9, color=[100 * r[3] for r in rows], colorscale="Viridis",
                                             cmin=0, cmax=50, showscale=col == 2,
                                             colorbar=dict(title="boosted (%)", len=0.7)),
                                 hovertemplate="%{text}<br>%{x:.2f} bits, KL %{y:.4g}<extra></extra>",
                                 name="setting", showlegend=col == 1), row=1, col=col)
        line = sorted((r for r in rows if r[flag]), key=lambda r: r[bits])
        fig.add_trace(go.Scatter(x=[r[bits] for r in line], y=[r[6] for r in line], mode="lines",
                                 line=dict(color="#333", width=2, dash="dot"), name="Pareto frontier",
                                 showlegend=col == 1), row=1, col=col)
        marked = [r for r in rows if r[10]]
        fig.add_trace(go.Scatter(x=[r[bits] for r in marked], y=[r[6] for r in marked], mode="markers+text",
                                 text=[r[10] for r in marked], textposition="top center",
                                 marker=dict(size=16, symbol="star", color="#F58518"),
                                 name="paper defaults", showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title="bits per stored K/V element", row=1, col=col)
    fig.update_yaxes(title="KL from FP16 (nats/token)", type="log")
    return _layout(fig, f"Pareto frontier over sink, window, page and alpha · {_subtitle(result)}", height=480)


FIGURES = {"selection": selection_figure, "channels": channels_figure, "masks": masks_figure, "layers": layers_figure,
           "pareto": pareto_figure}
