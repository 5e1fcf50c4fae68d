"""The Insights tab: studies the paper leaves open (backend.insights). Each shows at once the record precomputed
for the default model (labelled, with the command that made it) and offers a live run on the loaded model with
progress; a finished live run is remembered, so showing it again is instant. The per-channel study redraws any
layer and KV head of its record without running again."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import gradio as gr

from backend import insights
from backend.analysis import bundled_text
from backend.insights.common import min_tokens
from backend.insights.figures import FIGURES, channels_figure
from backend.methods import PRESETS

from .render import status_html
from .services import Services
from .teaching_tab import progress_html, stream_job

INTRO = """### Beyond the paper: what else decides how well a 2-bit cache works
Five studies on the loaded model. Each first shows numbers **precomputed for the default model** (SmolLM2-135M,
float32 on a CPU) with the command that made them; **Run live** repeats it on the model this server has loaded,
with progress (seconds to minutes on a CPU: every setting reads the text through its own cache as decoding
reads it, as in the Teaching tab). KL is the teacher-forced KL divergence from the FP16 cache's next-token distribution."""

STUDIES = {
    "selection": ("1 · Query-aware channel selection",
                  "Kitty boosts the channels with the largest mean |k|. Attention feels the error of q · k, so the "
                  "`query` selection boosts the channels with the largest **E[q²] × 2-bit error** (queries seen so "
                  "far; same memory, same page layout). Compared with magnitude and random at α = 1/16, 1/8, 1/4: "
                  "9 caches, then pass-key questions."),
    "channels": ("2 · Which channels matter (paper Figure 2b)",
                 "Each key channel alone at 2 bits: how much the softmax attention weights move (per query head of "
                 "the group), beside the two rankings a cache can compute online. A ranking that follows the "
                 "error protects the right channels. One FP16 pass; pick any layer and KV head."),
    "masks": ("3 · Mask dynamics",
              "How much the boosted set changes from one 128-token page to the next (Jaccard index, per layer), "
              "and what a mask chosen on the first page and then frozen costs against choosing per page."),
    "layers": ("4 · Per-layer sensitivity and a layer-wise budget",
               "The KL when only one layer is at 2 bits (one cache per layer), then the same total of boosted "
               "channels shared out by that sensitivity against Kitty's uniform α: same bytes, better quality? "
               "The budgets are checked again on a held-out text (the bundled text's end)."),
    "pareto": ("5 · Pareto frontier over S, R, G and α",
               "24 settings of sink S, value window R, page size G and boost share α: bits per element against "
               "KL, at this text's length and projected to 32K tokens. The paper's defaults are the stars."),
}


def source_note(result: dict, live: bool) -> str:
    """Where the shown numbers come from: a live run here, or the shipped record and its command."""
    when = f"{result['model']} · {result['device']} {result['dtype']} · {result['date']}"
    if live:
        return f"**Live run** on the loaded model: {when}."
    return (f"**Precomputed** for {when}, by `{result.get('command', 'python -m backend.insights all')}`. "
            "Run live below to measure the loaded model.")


@dataclass
class StudyView:
    name: str
    inputs: list
    outputs: list                          # progress, source note, summary, table, plot (+ state for channels)


@dataclass
class InsightsPage:
    services: Services
    precomputed: dict[str, dict]
    views: dict[str, StudyView] = field(default_factory=dict)

    def __post_init__(self):
        self._results: dict[tuple, dict] = {}

    def shown(self, name: str, result: dict | None, live: bool) -> list:
        """The non-progress outputs of a study for a record: source note, summary, table, plot."""
        if result is None:
            return ["No precomputed record ships for this study: run it live.", "", [], None]
        return [source_note(result, live), result["summary"], table_value(result), FIGURES[name](result)]

    def run(self, name: str, text_tokens, layer=None) -> Iterator[list]:
        """Stream a live run's progress, then its record (remembered under the model and settings)."""
        model, tokenizer = self.services.models.default
        overrides = {"tokens": int(text_tokens)}
        if name == "channels":
            overrides["layers"] = [int(layer)]
        extra = [gr.update()] if name == "channels" else []
        key = (name, model.kitty_model_name, tuple(sorted((k, str(v)) for k, v in overrides.items())))
        if key in self._results:
            result = self._results[key]
            yield [status_html("ok", "Shown from an earlier live run with the same settings."),
                   *self.shown(name, result, True), *([result] if extra else [])]
            return
        started = time.monotonic()
        job = lambda progress: insights.run_study(name, model, tokenizer, progress=progress, **overrides)  # noqa
        for event in stream_job(job):
            if event[0] == "progress":
                yield [progress_html(event[1], event[2], started), *[gr.update()] * 4, *extra]
            elif event[0] == "error":
                yield [status_html("error", event[1]), *[gr.update()] * 4, *extra]
            else:
                self._results[key] = event[1]
                yield [status_html("ok", f"Finished in {time.monotonic() - started:.0f} s."),
                       *self.shown(name, event[1], True), *([event[1]] if extra else [])]

    @staticmethod
    def redraw_channels(result: dict | None, layer, head):
        """The per-channel figure of another layer / KV head of the shown record (no new run)."""
        if not result or str(int(layer)) not in result["layers"]:
            return gr.update()
        heads = result["layers"][str(int(layer))]
        return channels_figure(result, int(layer), min(int(head), len(heads) - 1))


def study_block(page: InsightsPage, name: str, max_tokens: int, layers: int, kv_heads: int) -> StudyView:
    """One study: its explanation and controls beside its progress, source note, summary, table and plot."""
    title, description = STUDIES[name]
    record = page.precomputed.get(name)
    module = insights.STUDIES[name]
    default_tokens = module.SETTINGS["full"]["tokens"]
    low = min_tokens(PRESETS["kitty"])
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            gr.Markdown(f"#### {title}\n{description}")
            # the layer study also needs a disjoint held-out text of the same length
            top = max_tokens // 2 if name == "layers" else max_tokens
            tokens = gr.Slider(low, top, value=min(default_tokens, top), step=1,
                               label="Text length for a live run (tokens)", elem_id=f"insights-{name}-tokens")
            inputs = [tokens]
            if name == "channels":
                layer = gr.Slider(0, layers - 1, value=layers // 2, step=1, label="Layer (live run and figure)",
                                  elem_id="insights-channels-layer")
                head = gr.Slider(0, kv_heads - 1, value=0, step=1, label="KV head (figure)",
                                 elem_id="insights-channels-head")
                inputs.append(layer)
            button = gr.Button("Run live", variant="secondary", elem_id=f"insights-{name}-run")
        with gr.Column(scale=3):
            progress = gr.HTML("", elem_id=f"insights-{name}-progress")
            note, summary, rows, figure = page.shown(name, record, live=False)
            if name == "channels" and record and str(layer.value) in record["layers"]:
                figure = channels_figure(record, layer.value, 0)
            source = gr.Markdown(note, elem_id=f"insights-{name}-source")
            text = gr.Markdown(summary, elem_id=f"insights-{name}-summary")
            table = gr.Dataframe(value=rows or None, headers=module.COLUMNS, interactive=False, label="Results",
                                 elem_id=f"insights-{name}-table")
            plot = gr.Plot(figure, label=title, elem_id=f"insights-{name}-plot")
    outputs = [progress, source, text, table, plot]
    if name == "channels":
        state = gr.State(record)
        outputs.append(state)
        for control in (layer, head):
            control.change(page.redraw_channels, [state, layer, head], [plot], api_visibility="private")
    view = StudyView(name, inputs, outputs)
    limit = page.services.config.teaching_concurrency
    # Studies keep the CPU busy for minutes: the teaching group's queue, apart from comparisons and page loads
    button.click(partial(page.run, name), inputs, outputs, concurrency_id="teaching", concurrency_limit=limit,
                 show_progress="hidden", api_visibility="private")
    return view


def table_value(result: dict) -> dict:
    """A record's table with its own headers (a live run's may differ from the shipped one's)."""
    return {"headers": result["columns"], "data": result["rows"]}


def build(services: Services) -> InsightsPage:
    model, tokenizer = services.models.default
    text = model.config.get_text_config()
    max_tokens = tokenizer(bundled_text(), return_tensors="pt")["input_ids"].shape[1]
    page = InsightsPage(services, insights.load_precomputed())
    gr.Markdown(INTRO)
    for name in STUDIES:
        page.views[name] = study_block(page, name, max_tokens, text.num_hidden_layers, text.num_key_value_heads)
    return page

