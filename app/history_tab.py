"""The History tab: past runs from the database, filtered by method, model and date; one run reopened with its
answers (the first token that differs from FP16's highlighted), metrics (teacher-forced scores included) and
plots; a leaderboard of votes and measured quality per method; CSV export. A permalink (/?run=<slug>) opens this
tab on that run; before a run is open, guidance stands where its answers and plots will be.

Database failures show their short reason; the details (paths, the database URL) go to the server log only."""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from html import escape
from pathlib import Path

import gradio as gr

from storage import VOTE_TIE, RunDetail, StorageError

from . import plots
from .render import fmt_bytes, fmt_ratio, fmt_token, marked_answer, permalink_html, status_html
from .runlog import stored_boost
from .services import Services

log = logging.getLogger(__name__)

ANY = "any"
RUN_COLUMNS = ["run", "when (UTC)", "model", "methods", "status", "prompt"]
METRIC_COLUMNS = ["method", "status", "top-1 vs FP16 (teacher-forced)", "KL from FP16", "first different choice",
                  "free-running match", "tokens", "tok/s", "first token (s)", "KV cache", "vs FP16", "bits K / V",
                  "peak memory", "error"]
LEADERBOARD_COLUMNS = ["method", "votes won", "votes on runs with it", "ties", "win rate", "answers scored",
                       "mean top-1 vs FP16", "mean KL from FP16"]
GUIDE = ('<div class="kitty-guide">Click a run in the list above, or type its id, to see its answers side by side, '
         'their metrics (teacher-forced agreement with FP16 included) and the plots of its caches.</div>')
LIST_LIMIT = 200
RUN_ID = re.compile(r"[A-Za-z0-9]{1,32}")    # a slug (10 letters and digits) or a numeric id
EXPORT_TTL_S = 60.0     # Gradio copies an export into its own cache when it answers: ours can go soon after


def _unavailable(what: str, exc: StorageError) -> str:
    log.warning("%s: %s", what, exc)
    return status_html("warning", f"{what}: {exc.reason}.")


class ExportFolder:
    """This process's CSV exports, in one temporary folder that goes when the process ends; each export removes
    those older than EXPORT_TTL_S, so files do not pile up while the server runs."""

    def __init__(self):
        self._path: str | None = None

    def new_file(self) -> str:
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="kitty-exports-")
            atexit.register(shutil.rmtree, self._path, True)
        for old in Path(self._path).iterdir():
            if time.time() - old.stat().st_mtime > EXPORT_TTL_S:
                old.unlink(missing_ok=True)
        handle, path = tempfile.mkstemp(prefix="kitty-runs-", suffix=".csv", dir=self._path)
        os.close(handle)
        return path


@dataclass
class OpenRun:
    """The run on screen (a gr.State), with its page stats regrouped per method and layer for the plots."""

    detail: RunDetail | None = None
    boost: dict = field(default_factory=dict)      # method -> {layer: (masks, magnitudes) (pages, H, D)}


def _utc(value) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, timezone.utc)
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def date_range(since, until) -> tuple[datetime | None, datetime | None]:
    """A date picked without a time means the whole day: 'until' then runs to that day's end."""
    since, until = _utc(since), _utc(until)
    if until is not None and (until.hour, until.minute, until.second) == (0, 0, 0):
        until += timedelta(days=1, microseconds=-1)
    return since, until


def _score(result) -> list:
    """The teacher-forced columns of one stored answer."""
    metrics = result.metrics
    if result.kl_from_fp16 is None:
        why = "reference" if result.method == "fp16" and metrics.get("score_status") == "reference" else \
            metrics.get("score_note") or "–"
        return [why, "–", "–"]
    first = "none" if result.first_difference is None else f"token {result.first_difference + 1}: " + \
        " for ".join(fmt_token(t) for t in reversed(metrics.get("first_difference_tokens") or [None, None]))
    return [f"{result.top1_agreement:.0%}", f"{result.kl_from_fp16:.3g}", first]


def metrics_rows(detail: RunDetail) -> list[list]:
    rows = []
    for r in detail.results:
        ratio = r.kv_bytes / r.fp16_bytes if r.kv_bytes and r.fp16_bytes else None
        rows.append([r.method, r.metrics.get("status", "error" if r.error else "done"), *_score(r),
                     "–" if r.agreement is None else f"{r.agreement:.0%}", r.n_tokens,
                     None if r.tokens_per_s is None else round(r.tokens_per_s, 2),
                     None if r.ttft_s is None else round(r.ttft_s, 3), fmt_bytes(r.kv_bytes), fmt_ratio(ratio),
                     f"{r.key_bits:.1f} / {r.value_bits:.1f}" if r.key_bits is not None else "–",
                     fmt_bytes(r.peak_memory_bytes), r.error or ""])
    return rows


def leaderboard_rows(board) -> list[list]:
    return [[row.method, row.wins, row.votes, row.ties, "–" if row.win_rate is None else f"{row.win_rate:.0%}",
             row.scored, "–" if row.top1_agreement is None else f"{row.top1_agreement:.1%}",
             "–" if row.kl_from_fp16 is None else f"{row.kl_from_fp16:.3g}"] for row in board]


def methods_cell(methods: list[str], states: list[str]) -> str:
    """The run list's methods, each with how it ended unless it simply finished."""
    return ", ".join(m if s == "done" else f"{m} ({'failed' if s == 'error' else s})"
                     for m, s in zip(methods, states or ["done"] * len(methods)))


def votes_text(votes) -> str:
    if not votes:
        return "no votes yet"
    counts = {}
    for vote in votes:
        name = "tie" if vote.choice == VOTE_TIE else vote.choice
        counts[name] = counts.get(name, 0) + 1
    return f"{len(votes)} vote(s): " + ", ".join(f"{name} {n}" for name, n in counts.items())


def run_header_html(detail: RunDetail, votes=()) -> str:
    when = detail.created_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    generation = detail.settings.get("generation", {})
    mode = "sampling" if generation.get("sample") else "greedy"
    turns = sum(m.get("role") == "user" for m in detail.messages)
    return (f'<div class="kitty-run-head"><h3>Run {escape(detail.slug)}{permalink_html(detail.slug)}</h3>'
            f'<div>{escape(when)} · {escape(detail.model)} · status {escape(detail.status)} · {mode}, '
            f'{generation.get("max_new_tokens", "?")} new tokens max, seed {generation.get("seed", "?")} · '
            f'turn {turns} of the chat · {votes_text(votes)}</div>'
            f'<div class="kitty-prompt"><b>Prompt:</b> {escape(detail.prompt)}</div></div>')


def answers_html(detail: RunDetail) -> str:
    """Every method's answer side by side, in its colour, its first token that differs from FP16's highlighted."""
    cards = []
    for r in detail.results:
        error = f'<div class="kitty-pane-error">✕ {escape(r.error)}</div>' if r.error else ""
        answer = marked_answer(r.output_text, r.metrics.get("divergence_chars"), html=True)
        cards.append(f'<div class="kitty-card" style="border-top-color:{plots.color(r.method)}">'
                     f'<div class="kitty-card-title">{escape(r.method)}</div>{error}'
                     f'<div class="kitty-answer">{answer or "<i>(no text)</i>"}</div></div>')
    return f'<div class="kitty-cards">{"".join(cards)}</div>'


def stored_figures(run: OpenRun, method: str, layer: int, head: int) -> list:
    """Boost mask, per-page key magnitudes, KV bytes and speed of a stored run."""
    if run.detail is None:
        return [plots.empty_figure(t, "Open a run to see this plot.") for t in
                ("Boost mask", "Key magnitudes", "KV cache size", "Decode speed")]
    layers = run.boost.get(method, {})
    if layer in layers:
        masks, magnitudes = layers[layer]
        head = min(head, masks.shape[1] - 1)
        mask_fig = plots.boost_mask_figure(masks[:, head], method, layer, head)
        magnitude_fig = plots.magnitude_figure(magnitudes[:, head], method, layer, head, per_page=True,
                                               note="per-token maps are live only")
    else:
        why = (f"{method} stored no key pages in layer {layer}: page stats are kept for methods with boosted "
               f"channels once a page forms.")
        mask_fig = plots.empty_figure(f"Boost mask · {method} · layer {layer}", why)
        magnitude_fig = plots.empty_figure(f"Key magnitudes · {method} · layer {layer}", why)
    timelines = {r.method: r.metrics.get("timeline", []) for r in run.detail.results}
    bytes_series = {m: ([p[0] for p in t], [p[2] for p in t]) for m, t in timelines.items()}
    speed_series = {m: ([p[0] for p in t if p[3]], [p[3] for p in t if p[3]]) for m, t in timelines.items()}
    return [mask_fig, magnitude_fig, plots.kv_bytes_figure(bytes_series), plots.speed_figure(speed_series)]


@dataclass
class HistoryPage:
    services: Services
    filters: list                 # method, model, since, until
    table: gr.Dataframe
    list_message: gr.HTML         # about the list (its count, a failed search or export)
    leaderboard: gr.Dataframe
    run_state: gr.State
    message: gr.HTML              # about the run asked for (opened, or why not): a list refresh leaves it alone
    slug_box: gr.Textbox
    guide: gr.HTML                # stands where a run's answers and plots will be, until one is open
    run_box: gr.Column
    header: gr.HTML
    answers: gr.HTML
    metrics: gr.Dataframe
    plot_controls: list           # method, layer, head
    figures: list
    csv_file: gr.File
    exports: ExportFolder = field(default_factory=ExportFolder)

    @property
    def view_outputs(self) -> list:
        return [self.run_state, self.message, self.slug_box, self.guide, self.run_box, self.header, self.answers,
                self.metrics, self.plot_controls[0], *self.figures]

    @property
    def search_outputs(self) -> list:
        return [self.table, self.list_message, *self.filters[:2], self.leaderboard]

    def search(self, method, model, since, until):
        """The filtered run list, with fresh filter choices, and the leaderboard (of the chosen model's runs)."""
        db = self.services.runlog
        model = None if model in (None, ANY) else model
        try:
            start, end = date_range(since, until)
            runs = db.database().list_runs(method=None if method in (None, ANY) else method, model=model,
                                           since=start, until=end, limit=LIST_LIMIT)
            methods, models = db.database().distinct_methods(), db.database().distinct_models()
            board = db.database().leaderboard(model)
        except StorageError as exc:
            return [], _unavailable("The history is unavailable", exc), gr.update(), gr.update(), gr.update()
        rows = [[r.slug, r.created_at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M"), r.model,
                 methods_cell(r.methods, r.method_status), r.status, r.prompt] for r in runs]
        shown = f"the newest {LIST_LIMIT} runs" if len(rows) == LIST_LIMIT else f"{len(rows)} run(s)"
        note = status_html("info", f"{shown}. Click a row to open it.")
        return (rows, note, gr.update(choices=[ANY, *methods]), gr.update(choices=[ANY, *models]),
                leaderboard_rows(board))

    def open_run(self, slug: str | None, method=None, layer=10, head=0):
        """Everything shown for one run (outputs in the order of view_outputs); the guidance until one opens."""
        slug = (slug or "").strip()
        blank = [OpenRun(), None, slug, gr.update(visible=True), gr.update(visible=False), "", "", [], gr.update(),
                 *stored_figures(OpenRun(), "", 0, 0)]
        if not slug:
            blank[1] = status_html("error", "Type a run id (the part after ?run= in a permalink).")
            return blank
        if not RUN_ID.fullmatch(slug):
            shown = slug if len(slug) <= 40 else slug[:40] + "…"
            blank[1] = status_html("error", f"{shown!r} is not a run id: run ids are letters and digits, like "
                                            f"aB3dE5gH7j.")
            return blank
        try:
            detail = self.services.runlog.get(slug)
            votes = self.services.runlog.database().votes(slug) if detail is not None else []
        except StorageError as exc:
            blank[1] = _unavailable("Could not open the run", exc)
            return blank
        if detail is None:
            blank[1] = status_html("error", f"No run {slug!r} in this database.")
            return blank
        run = OpenRun(detail, {r.method: stored_boost(r) for r in detail.results})
        methods = [r.method for r in detail.results]
        boosted = [m for m in methods if run.boost.get(m)]
        method = method if method in methods else (boosted or methods)[0]
        return [run, status_html("ok", f"Run {detail.slug} opened."), detail.slug, gr.update(visible=False),
                gr.update(visible=True), run_header_html(detail, votes), answers_html(detail), metrics_rows(detail),
                gr.update(choices=methods, value=method), *stored_figures(run, method, int(layer), int(head))]

    def select_row(self, table, plot_method, layer, head, evt: gr.SelectData):
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        slug = table.iloc[row, 0] if hasattr(table, "iloc") else table[row][0]
        return self.open_run(slug, plot_method, layer, head)

    def export(self, method, model, since, until):
        path = self.exports.new_file()
        try:
            start, end = date_range(since, until)
            count = self.services.runlog.database().export_csv(
                path, method=None if method in (None, ANY) else method,
                model=None if model in (None, ANY) else model, since=start, until=end)
        except StorageError as exc:
            os.unlink(path)
            return gr.update(visible=False), _unavailable("Export failed", exc)
        return gr.update(value=path, visible=True), status_html("ok", f"Exported {count} row(s), one per method.")

    def redraw(self, run: OpenRun, method, layer, head):
        return stored_figures(run, method, int(layer), int(head))


def build(services: Services) -> HistoryPage:
    text_config = services.models.default[0].config.get_text_config()
    layers, kv_heads = text_config.num_hidden_layers, text_config.num_key_value_heads
    with gr.Row(equal_height=True):
        method = gr.Dropdown([ANY], value=ANY, label="Method", allow_custom_value=False, min_width=140)
        model = gr.Dropdown([ANY], value=ANY, label="Model", min_width=180)
        since = gr.DateTime(label="From (UTC)", include_time=False, type="datetime", timezone="UTC")
        until = gr.DateTime(label="To (UTC)", include_time=False, type="datetime", timezone="UTC")
        with gr.Column(min_width=150):
            search = gr.Button("Search", variant="primary", elem_id="history-search")
            export = gr.Button("Export CSV", elem_id="history-export")
    csv_file = gr.File(label="CSV export", visible=False, elem_id="history-csv")
    list_message = gr.HTML("", elem_id="history-status")
    table = gr.Dataframe(headers=RUN_COLUMNS, value=[], interactive=False, wrap=True, max_height=330,
                         column_widths=["9%", "11%", "14%", "20%", "7%", "39%"], elem_id="history-table",
                         label="Runs (newest first): click one to open it", elem_classes="kitty-fit")
    with gr.Accordion("Leaderboard: votes and measured quality per method", open=True, elem_id="leaderboard-box"):
        gr.Markdown("Votes come from the Compare tab (blind or not); quality is each answer's teacher-forced score "
                    "against FP16's answer of the same run (FP16 is the reference, so it has none). Counts say how "
                    "much each figure rests on.", elem_classes="kitty-footnote")
        leaderboard = gr.Dataframe(headers=LEADERBOARD_COLUMNS, value=[], interactive=False, wrap=True,
                                   elem_id="leaderboard", show_label=False, elem_classes="kitty-fit")
    with gr.Row(equal_height=True):
        slug_box = gr.Textbox(label="Open a run by id", placeholder="e.g. aB3dE5gH7j", scale=4, elem_id="run-id")
        open_button = gr.Button("Open", scale=1, elem_id="open-run")
    run_state = gr.State(OpenRun())
    message = gr.HTML("", elem_id="run-status")
    guide = gr.HTML(GUIDE, elem_id="history-guide")
    with gr.Column(visible=False, elem_id="run-view") as run_box:
        header = gr.HTML("", elem_id="run-header")
        answers = gr.HTML("", elem_id="run-answers")
        metrics = gr.Dataframe(headers=METRIC_COLUMNS, value=[], interactive=False, wrap=True, label="Metrics",
                               elem_id="run-metrics", elem_classes="kitty-fit")
        with gr.Row():
            plot_method = gr.Dropdown([], label="Method", scale=1, elem_id="history-plot-method")
            layer = gr.Slider(0, layers - 1, value=min(10, layers - 1), step=1, label="Layer", scale=2)
            head = gr.Slider(0, kv_heads - 1, value=0, step=1, label="KV head", scale=2)
        with gr.Row():
            mask_plot = gr.Plot(show_label=False, elem_id="history-boost-plot")
            magnitude_plot = gr.Plot(show_label=False, elem_id="history-magnitude-plot")
        with gr.Row():
            bytes_plot = gr.Plot(show_label=False, elem_id="history-bytes-plot")
            speed_plot = gr.Plot(show_label=False, elem_id="history-speed-plot")

    page = HistoryPage(services, [method, model, since, until], table, list_message, leaderboard, run_state, message,
                       slug_box, guide, run_box, header, answers, metrics, [plot_method, layer, head],
                       [mask_plot, magnitude_plot, bytes_plot, speed_plot], csv_file)
    search.click(page.search, page.filters, page.search_outputs, api_visibility="private")
    export.click(page.export, page.filters, [csv_file, list_message], api_visibility="private")
    table.select(page.select_row, [table, plot_method, layer, head], page.view_outputs, api_visibility="private")
    gr.on([open_button.click, slug_box.submit], page.open_run, [slug_box, plot_method, layer, head],
          page.view_outputs, api_visibility="private")
    gr.on([plot_method.change, layer.release, head.release], page.redraw, [run_state, plot_method, layer, head],
          page.figures, show_progress="hidden", api_visibility="private")
    return page
