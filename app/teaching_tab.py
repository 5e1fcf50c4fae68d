"""The Teaching tab: "why 2-bit collapses". Precomputed results for the default model show at once (the
pass-key test at several thousand tokens, the quality suite over the whole bundled text, the anatomy of one real
key page); below, one click runs backend.teaching's suite on the loaded model and shows a table and bars, a
second runs the boost sweep (the paper's Figure 4). Progress streams while they run; a finished result is
remembered, so showing it again to the next class is instant."""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import gradio as gr

from backend import teaching
from backend.analysis import bundled_text
from backend.engine import InputError, resolve_methods
from backend.methods import METHODS

from . import plots
from .render import status_html
from .services import Services

DEFAULT_SUITE_METHODS = ["kivi-k4v4", "kivi-k2v2", "kivi-k2v2*", "kitty"]
DEPTHS = {"10%": 0.1, "50%": 0.5, "90%": 0.9}
FRACTIONS = {"0%": 0.0, "12.5%": 0.125, "25%": 0.25, "50%": 0.5, "100%": 1.0}
INTRO = """### Why uniform 2-bit KV quantization collapses, and how Kitty fixes it
A KV cache stores every token's keys and values. Storing them in 2 bits instead of 16 saves 8x memory, but a
few **key channels** have much larger values than the rest (see the magnitude plot on the Compare tab); squeezed
into 4 levels they lose most of their information, and attention goes wrong. **KIVI-K4V4** (4 bits) barely
changes the model; **KIVI-K2V2** (2 bits) drifts away from it. **Kitty** keeps 2 bits but stores the top 12.5%
of channels of each 128-token page (by magnitude) at 4 bits, and lands close to 4-bit quality.

The suite reads a fixed English text (Alice in Wonderland) through each cache, as decoding reads it, and compares
the next-token predictions with FP16: **KL divergence** (0 = identical), **top-1 agreement** and **perplexity**;
then it hides a 5-digit pass key in filler text and asks for it. *Bits/element in full pages* is what each
method's pages cost, metadata included (what a long chat tends to); *KV used vs FP16* is measured on this
text, where the 16-bit sink and newest tokens are still a large share."""


def progress_html(fraction: float, message: str, started: float) -> str:
    return (f'<div class="kitty-progress"><div class="kitty-bar" style="width:{100 * fraction:.1f}%"></div></div>'
            f'<div class="kitty-progress-text">{fraction:.0%} · {message} · {time.monotonic() - started:.0f} s</div>')


def stream_job(job: Callable[[Callable[[float, str], None]], object]) -> Iterator[tuple]:
    """Run job(progress) in a thread; yield ("progress", fraction, message) while it runs, then ("done", result)
    or ("error", message). The Gradio handler stays a plain generator that streams progress."""
    events: queue.SimpleQueue = queue.SimpleQueue()

    def work():
        try:
            events.put(("done", job(lambda fraction, message: events.put(("progress", fraction, message)))))
        except InputError as exc:
            events.put(("error", str(exc)))
        except Exception as exc:                      # shown in the page, not as a stack trace
            events.put(("error", f"{type(exc).__name__}: {exc}"))

    threading.Thread(target=work, name="teaching", daemon=True).start()
    last = ("progress", 0.0, "starting")
    while True:
        event = events.get()
        if event[0] != "progress":
            yield event
            return
        last = event
        while not events.empty():                     # only the newest progress matters
            event = events.get()
            if event[0] != "progress":
                yield last
                yield event
                return
            last = event
        yield last
        time.sleep(0.25)


@dataclass
class TeachingPage:
    services: Services
    suite_inputs: list
    suite_outputs: list
    sweep_inputs: list
    sweep_outputs: list
    latest: dict = field(default_factory=dict)    # experiment -> [progress, table, plot] of its last finished run

    def __post_init__(self):
        self._results: dict[tuple, teaching.Table] = {}

    def _run(self, key: tuple, job, render) -> Iterator[list]:
        """Stream a job's progress into [progress, table, plot]; remember its result under `key`, and as the
        experiment's latest, which a page (re)load shows at once."""
        if key in self._results:
            yield [status_html("ok", "Shown from an earlier run with the same settings (same model, same "
                                     "inputs, same numbers)."), *render(self._results[key])]
            return
        started = time.monotonic()
        for event in stream_job(job):
            if event[0] == "progress":
                yield [progress_html(event[1], event[2], started), gr.update(), gr.update()]
            elif event[0] == "error":
                yield [status_html("error", event[1]), gr.update(), gr.update()]
            else:
                self._results[key] = event[1]
                self.latest[key[0]] = [status_html("ok", f"The last run, kept: {describe_key(key)}."),
                                       *render(event[1])]
                yield [status_html("ok", f"Finished in {time.monotonic() - started:.0f} s."), *render(event[1])]

    def remembered(self) -> list:
        """What a page (re)load shows: each experiment's last finished run, if any."""
        return [*self.latest.get("suite", [gr.update()] * 3), *self.latest.get("sweep", [gr.update()] * 3)]

    def run_suite(self, methods, text_tokens, depths):
        model, tokenizer = self.services.models.default
        try:
            configs = resolve_methods([m for m in methods or [] if m != "fp16"] or ["fp16"])
            points = tuple(DEPTHS[d] for d in depths or [])
            if not points:
                raise InputError("Choose at least one pass-key depth.")
            tokens = int(text_tokens)
        except InputError as exc:
            yield [status_html("error", str(exc)), gr.update(), gr.update()]
            return
        key = ("suite", model.kitty_model_name, tuple(configs), tokens, points)
        yield from self._run(
            key, lambda progress: teaching.run_suite(model, tokenizer, configs, text_tokens=tokens, depths=points,
                                                     progress=progress),
            lambda table: [table.rows, plots.suite_figure(table.records())])

    def run_sweep(self, fractions, text_tokens):
        model, tokenizer = self.services.models.default
        try:
            points = tuple(sorted(FRACTIONS[f] for f in fractions or []))
            if len(points) < 2:
                raise InputError("Choose at least two boost fractions to draw a curve.")
            ids = teaching.text_ids(tokenizer, int(text_tokens))
        except InputError as exc:
            yield [status_html("error", str(exc)), gr.update(), gr.update()]
            return
        key = ("sweep", model.kitty_model_name, points, int(text_tokens))
        yield from self._run(
            key, lambda progress: teaching.boost_sweep(model, ids, fractions=points, progress=progress),
            lambda table: [table.rows, plots.sweep_figure(table.records())])


def describe_key(key: tuple) -> str:
    """The settings of a remembered run, from its key (see run_suite / run_sweep)."""
    if key[0] == "suite":
        _, model, methods, tokens, depths = key
        return (f"{model}, {', '.join(methods)}, {tokens} tokens, pass key at "
                f"{', '.join(f'{d:.0%}' for d in depths)}")
    _, model, fractions, tokens = key
    return f"{model}, boost fractions {', '.join(f'{f:.1%}' for f in fractions)}, {tokens} tokens"


def results_column(name: str, columns: list[str], table_label: str) -> list:
    """An experiment's outputs, side by side with its controls: progress line, results table and plot
    (elem_ids {name}-progress, {name}-table, {name}-plot)."""
    with gr.Column(scale=3):
        progress = gr.HTML("", elem_id=f"{name}-progress")
        table = gr.Dataframe(headers=columns, value=[], interactive=False, label=table_label, wrap=True,
                             elem_id=f"{name}-table")
        plot = gr.Plot(show_label=False, elem_id=f"{name}-plot")
    return [progress, table, plot]


def precomputed_note(data: dict) -> str:
    return (f"Precomputed on {data['date'][:10]} for {data['model']} ({data['machine']['device']}, "
            f"{data['machine']['dtype']}, {data['seconds'] // 60} min) with `{data['command']}`: the same model and "
            f"inputs give the same numbers. Run the suite yourself below for a shorter live version.")


def passkey_rows(grid: dict) -> list[list]:
    """One row per method: keys found at each prompt length."""
    return [[method, *(f"{h}/{grid['questions']}" for h in hits)] for method, hits in grid["found"].items()]


def passkey_text(grid: dict) -> str:
    """What the pass-key grid shows, in words written from its own numbers (at its longest prompt)."""
    longest, n = grid["lengths"][-1], grid["questions"]
    found = ", ".join(f"{method} {hits[-1]}/{n}" for method, hits in grid["found"].items())
    return (f"A 5-digit secret number is hidden in the bundled story at {len(grid['depths'])} depths "
            f"({', '.join(f'{d:.0%}' for d in grid['depths'])}), with {len(grid['seeds'])} different number(s) each, "
            f"and the model is asked for it at the end. At {longest:,} tokens the keys found were: {found}. "
            "Uniform 2-bit keys lose the shape of the few loud key channels on every page; Kitty keeps those "
            "channels at 4 bits.")


def build_precomputed(services: Services) -> None:
    """The shipped results (backend/data/teaching_precomputed.json), shown as soon as the page loads."""
    data = teaching.load_precomputed()
    if data is None:
        gr.Markdown("*No precomputed results are shipped with this copy: run "
                    f"`{teaching.PRECOMPUTED_COMMAND}` once, or run the suite below.*", elem_id="precomputed-note")
        return
    other_model = data["model"] != services.models.default_name
    gr.Markdown("### Precomputed: the collapse at several thousand tokens\n" + precomputed_note(data) +
                (f"\n\n**These numbers are for {data['model']}; this server serves {services.models.default_name}.**"
                 if other_model else ""), elem_id="precomputed-note")
    grid, anatomy, suite = data["passkey"], data["anatomy"], data["suite"]
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            gr.Plot(plots.passkey_figure(grid), show_label=False, elem_id="precomputed-passkey-plot")
        with gr.Column(scale=2):
            gr.Markdown(passkey_text(grid), elem_id="precomputed-passkey-text")
            gr.Dataframe(headers=["method", *(f"{n:,} tokens" for n in grid["lengths"])],
                         value=passkey_rows(grid), interactive=False, label="Keys found",
                         elem_id="precomputed-passkey-table")
    gr.Markdown("#### Why: a few loud key channels\nEach bar is one key channel of one real 128-token page of this "
                "model. Per-channel min/max quantization gives every channel 4 levels (2 bits) between its own "
                "minimum and maximum: a loud channel's levels are far apart, so its values move a lot, and because "
                "its values are large they dominate the attention scores q·k. Kitty stores the loudest channels of "
                "each page (orange) with 16 levels.")
    with gr.Row():
        gr.Plot(plots.page_channels_figure(anatomy), show_label=False, elem_id="page-channels-plot")
        gr.Plot(plots.quantization_figure(anatomy), show_label=False, elem_id="quantization-plot")
    gr.Markdown(f"#### The quality suite over the whole bundled text ({suite['text_tokens']:,} tokens)")
    # the table takes the page's width (seven columns do not fit half of a laptop screen), its plot below
    gr.Dataframe(headers=suite["columns"], value=suite["rows"], interactive=False, label="Suite (precomputed)",
                 wrap=True, elem_id="precomputed-suite-table")
    gr.Plot(plots.suite_figure([dict(zip(suite["columns"], row)) for row in suite["rows"]]), show_label=False,
            elem_id="precomputed-suite-plot")


def build(services: Services) -> TeachingPage:
    tokenizer = services.models.default[1]
    max_tokens = tokenizer(bundled_text(), return_tensors="pt")["input_ids"].shape[1]
    gr.Markdown(INTRO)
    build_precomputed(services)
    gr.Markdown("### Run it yourself (live, on the loaded model)")
    text_tokens = gr.Slider(teaching.MIN_TEXT_TOKENS, max_tokens, value=teaching.DEFAULT_TEXT_TOKENS, step=1,
                            label="Text length (tokens)", elem_id="teaching-tokens",
                            info=f"at least {teaching.MIN_TEXT_TOKENS}: sink 32 + one 128-token key page + the "
                                 f"128-token value window, so that 2-bit pages exist; longer = slower, clearer")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            gr.Markdown("#### 1 · The quality suite")
            methods = gr.CheckboxGroup([m for m in METHODS if m != "fp16"], value=DEFAULT_SUITE_METHODS,
                                       label="Methods (FP16 always runs: it is the reference)",
                                       elem_id="teaching-methods")
            depths = gr.CheckboxGroup(list(DEPTHS), value=list(DEPTHS), label="Pass-key depths")
            suite_button = gr.Button("Run the suite", variant="primary", elem_id="run-suite")
        suite_outputs = results_column("suite", teaching.SUITE_COLUMNS, table_label="Results")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            gr.Markdown("#### 2 · The boost sweep (paper Figure 4)\nKIVI-K2V2* (2 bits, 32-token sink) with a "
                        "growing share of key channels at 4 bits, chosen by magnitude (Kitty), at random, or "
                        "query-aware (the channels the queries read most, weighted by their 2-bit error: beyond the "
                        "paper). If the choice did not matter, the curves would lie on top of each other.")
            fractions = gr.CheckboxGroup(list(FRACTIONS), value=list(FRACTIONS), label="Boost fractions")
            sweep_button = gr.Button("Run the boost sweep", variant="primary", elem_id="run-sweep")
        sweep_outputs = results_column("sweep", teaching.SWEEP_COLUMNS, table_label="Sweep")
    page = TeachingPage(services, [methods, text_tokens, depths], suite_outputs, [fractions, text_tokens],
                        sweep_outputs)
    gr.on(None, page.remembered, None, [*suite_outputs, *sweep_outputs], api_visibility="private")   # page load
    # The suite keeps the CPU busy for minutes: its own queue, apart from comparisons and page loads
    limit = services.config.teaching_concurrency
    suite_button.click(page.run_suite, page.suite_inputs, page.suite_outputs, concurrency_id="teaching",
                       concurrency_limit=limit, show_progress="hidden", api_visibility="private")
    sweep_button.click(page.run_sweep, page.sweep_inputs, page.sweep_outputs, concurrency_id="teaching",
                       concurrency_limit=limit, show_progress="hidden", api_visibility="private")
    return page
