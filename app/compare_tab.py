"""The Compare tab: one prompt to every chosen method, the answers streaming side by side, live metrics under
each pane and live plots of what the caches hold.

Every method has a fixed pane (shown while it is selected) holding its own chat: in a multi-turn chat each method
sees its own earlier answers, as a real deployment of that cache would. The handler drives a
backend.engine.Comparison and redraws text about seven times a second and plots about once a second.
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import gradio as gr
import numpy as np

from backend import memory
from backend.analysis import bundled_text
from backend.engine import (CUSTOM, REFERENCE, Comparison, GenerationSettings, InputError, MethodSnapshot, has_boost,
                            prepare_comparison, resolve_methods)
from backend.methods import METHODS, SELECTIONS, SUPPORTED_BITS, method_config
from storage import RunEntry

from . import plots
from .render import FOOTNOTE, metrics_html, pane_header, permalink_html, status_html
from .services import Services

log = logging.getLogger(__name__)

PANE_METHODS = [*METHODS, CUSTOM]
DEFAULT_METHODS = ["fp16", "kivi-k2v2", "kitty"]
PLOT_EVERY_S = 1.0                   # plots are heavier than text: redraw them about once a second
EXAMPLES = [
    "Explain in three sentences why the sky is blue.",
    "Write a short poem about a cat who guards a library.",
    "Summarize this story opening in two sentences:\n\n" + bundled_text()[:1600],
]


class CompareSession:
    """One browser tab's latest comparison (a gr.State), kept after it ends so that the plots can be redrawn for
    any method, layer and head; and the plot selection, which the streaming handler follows while it runs."""

    def __init__(self):
        self.comparison: Comparison | None = None
        self.view: tuple[str, int, int] = ("kitty", 10, 0)

    def stop(self) -> None:
        if self.comparison is not None:
            self.comparison.stop()


def _text(content) -> str:
    """A chat message's text: Gradio hands content back as a list of parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def history_messages(chat: list | None) -> list[dict]:
    """A pane's chat as model messages; error notes (messages with metadata) are display only."""
    messages = []
    for message in chat or []:
        if message.get("metadata"):
            continue
        text = _text(message.get("content"))
        if text or message.get("role") == "user":
            messages.append({"role": message["role"], "content": text})
    return messages


def answer_message(snap: MethodSnapshot) -> dict:
    if snap.status == "error":
        return {"role": "assistant", "content": snap.text + ("\n\n" if snap.text else "") + f"✕ {snap.error}",
                "metadata": {"title": "This method failed"}}
    text = snap.text or ("…" if snap.status in ("waiting", "running") else "(no tokens)")
    return {"role": "assistant", "content": text}


def _number(name: str, value) -> float:
    """A form field's number; an empty or non-numeric field is an InputError naming the field."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise InputError(f"{name} must be a number (got {value!r}).")
    return number


def _whole(name: str, value) -> int:
    number = _number(name, value) if value is not None else math.nan
    if not math.isfinite(number) or number != int(number):
        raise InputError(f"{name} must be a whole number (got {value!r}).")
    return int(number)


def generation_settings(max_new_tokens, decoding, temperature, top_p, top_k, seed) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=_whole("Max new tokens", max_new_tokens), sample=decoding == "sample",
                              temperature=_number("Temperature", temperature), top_p=_number("Top-p", top_p),
                              top_k=_whole("Top-k", top_k), seed=_whole("Seed", seed))


def custom_settings(k_bits, v_bits, alpha, sink, page_size, window, selection) -> dict:
    return dict(k_bits=_whole("Key bits", k_bits), v_bits=_whole("Value bits", v_bits),
                alpha=_number("Boost fraction", alpha), sink=_whole("Sink", sink),
                page_size=_whole("Page size", page_size), local_window=_whole("Window", window), selection=selection)


# ---------------------------------------------------------------------------------------------- plot data
def projection_figure(comparison: Comparison) -> object:
    """KV bytes against context length: each method's line from backend.memory, its measured sizes on it."""
    model_config = comparison.model.config
    grid = sorted({*np.geomspace(16, memory.PROJECTION_TOKENS[-1], 48).astype(int).tolist(),
                   *memory.PROJECTION_TOKENS})
    snaps = comparison.snapshots()
    lines = {label: (grid, [memory.sequence_bytes(snap.config, model_config, n) for n in grid])
             for label, snap in snaps.items()}
    # a point at the n-th new token measures the cache after prefill and n - 1 decode steps
    points = {label: ([snap.prompt_tokens + p.tokens - 1 for p in snap.timeline], [p.kv_bytes for p in snap.timeline])
              for label, snap in snaps.items()}
    return plots.kv_projection_figure(lines, points)


def live_figures(comparison: Comparison | None, method: str, layer: int, head: int) -> list:
    """The live figures for the session's comparison: boost mask, key magnitudes, KV bytes, speed, KV bytes
    against context length."""
    if comparison is None:
        return [plots.empty_figure(title, "Run a comparison to see this plot.") for title in
                ("Boost mask", "Key magnitudes", "KV cache size while generating", "Decode speed",
                 "KV cache size against context length")]
    snaps = comparison.snapshots()
    snap = snaps.get(method)
    layers = comparison.num_layers
    if snap is None:
        mask_fig = plots.empty_figure("Boost mask", f"{method} is not part of this comparison.")
        magnitude_fig = plots.empty_figure("Key magnitudes", f"{method} is not part of this comparison.")
    elif not 0 <= layer < layers:
        mask_fig = magnitude_fig = plots.empty_figure("Boost mask", f"This model has layers 0 to {layers - 1}.")
    else:
        masks = snap.boost_masks[layer] if layer < len(snap.boost_masks) else None
        if masks is not None and not has_boost(snap.config):
            mask_fig = plots.empty_figure(f"Boost mask · {method}",
                                          f"{method} boosts no channels: every key channel has "
                                          f"{snap.config.k_bits} bits.")
        else:
            head_ok = masks is not None and head < masks.shape[1]
            mask_fig = plots.boost_mask_figure(masks[:, head].numpy() if head_ok else None, method, layer, head)
        captured = comparison.key_magnitudes(method, layer)
        if captured is None or head >= captured.values.shape[0]:
            if not snap.finished:
                note = "Waiting for the next capture of this layer (every few tokens)…"
            elif comparison.released:
                note = "This run's caches were freed to save memory: run it again to explore other layers."
            else:
                note = "This layer holds no keys."
            magnitude_fig = plots.magnitude_figure(None, method, layer, head, note=note)
        else:
            values = captured.values[head].float().numpy()              # (T, D)
            cfg, pages = snap.config, 0 if masks is None else masks.shape[0]
            boundaries = [b for b in (cfg.sink + p * cfg.page_size for p in range(pages + 1))
                          if 0 < b < values.shape[0]]
            magnitude_fig = plots.magnitude_figure(values, method, layer, head, boundaries=boundaries,
                                                   note="dotted lines: sink and page edges" if boundaries else "")
    bytes_series = {label: ([p.elapsed_s for p in s.timeline], [p.kv_bytes for p in s.timeline])
                    for label, s in snaps.items()}
    speed_series = {label: ([p.elapsed_s for p in s.timeline if p.tokens_per_s],
                            [p.tokens_per_s for p in s.timeline if p.tokens_per_s]) for label, s in snaps.items()}
    return [mask_fig, magnitude_fig, plots.kv_bytes_figure(bytes_series), plots.speed_figure(speed_series),
            projection_figure(comparison)]


# ---------------------------------------------------------------------------------------------- the tab
@dataclass
class ComparePage:
    """The tab's components and handlers (the tests drive `send` directly)."""

    services: Services
    session: gr.State
    prompt: gr.Textbox
    methods: gr.CheckboxGroup
    custom: list                     # k_bits, v_bits, alpha, sink, page_size, window, selection
    generation: list                 # max_new_tokens, decoding, temperature, top_p, top_k, seed
    model_name: gr.Textbox
    plot_controls: list              # method, layer, head
    chats: dict                      # method -> gr.Chatbot
    metrics: dict                    # method -> gr.HTML
    figures: list                    # boost mask, magnitudes, kv bytes, speed, kv bytes against context length
    status: gr.HTML

    @property
    def send_inputs(self) -> list:
        return [self.session, self.prompt, self.methods, *self.custom, *self.generation, self.model_name,
                *self.plot_controls, *self.chats.values()]

    @property
    def send_outputs(self) -> list:
        return [self.status, self.prompt, self.plot_controls[0], *self.chats.values(), *self.metrics.values(),
                *self.figures]

    # -------------------------------------------------------------------- handlers
    def send(self, session: CompareSession, prompt, methods, k_bits, v_bits, alpha, sink, page_size, window,
             selection, max_new_tokens, decoding, temperature, top_p, top_k, seed, model_name, plot_method, layer,
             head, *chats):
        """Run the comparison, streaming every pane; the last update says whether the run was saved."""
        chats = dict(zip(PANE_METHODS, chats))
        try:
            settings = generation_settings(max_new_tokens, decoding, temperature, top_p, top_k, seed)
            custom = custom_settings(k_bits, v_bits, alpha, sink, page_size, window, selection) \
                if CUSTOM in (methods or []) else None
            configs = resolve_methods(methods, custom)
            if self.services.models.needs_loading(model_name):
                yield {self.status: status_html("running", f"Loading {model_name.strip()} (first use only)…")}
            model, tokenizer = self.services.models.get(model_name)
            user = {"role": "user", "content": (prompt or "").strip()}
            conversations = {label: history_messages(chats[label]) + [user] for label in configs}
            comparison = prepare_comparison(model, tokenizer, conversations, configs, settings,
                                            limits=self.services.config.limits)
        except InputError as exc:
            yield {self.status: status_html("error", str(exc))}
            return
        except Exception as exc:             # a bug, not the user's fault: say so in the page, log the details
            log.exception("could not start a comparison")
            yield {self.status: status_html("error", f"Could not start the comparison ({type(exc).__name__}: "
                                                     f"{exc}). The details are in the server log.")}
            return
        labels = comparison.labels
        method = plot_method if plot_method in labels else \
            next((label for label in labels if has_boost(configs[label])), labels[0])
        session.stop()
        session.comparison, session.view = comparison, (method, int(layer), int(head))
        comparison.set_focus(method, int(layer))
        shown = {label: list(chats[label] or []) + [user] for label in labels}
        has_reference = REFERENCE in labels
        messages = conversations[labels[0]]
        run = self.services.runlog.begin(model.kitty_model_name, messages, settings, labels)   # "running" now
        comparison.start()
        last_plot, finished = 0.0, False
        try:
            yield {self.status: status_html("running", f"Generating with {len(labels)} methods at the same time…"),
                   self.prompt: "", self.plot_controls[0]: gr.update(choices=labels, value=method)}
            for snaps in comparison.updates():
                update = {self.chats[label]: shown[label] + [answer_message(snap)] for label, snap in snaps.items()}
                update.update({self.metrics[label]: metrics_html(snap, comparison.memory_label, has_reference)
                               for label, snap in snaps.items()})
                if time.perf_counter() - last_plot >= PLOT_EVERY_S or comparison.finished:
                    last_plot = time.perf_counter()
                    update.update(zip(self.figures, live_figures(comparison, *session.view)))
                yield update
            finished = True
            self._keep(comparison)
            yield {self.status: self._save(run, snaps, comparison)}
        finally:
            if not finished:             # the page went away mid-run (Gradio closed this generator)
                self.services.runlog.abandon(run, comparison)

    def _keep(self, comparison: Comparison) -> None:
        """Caches hold every key and value: an idle tab's plots can still explore any layer of the latest
        comparisons, within the operator's memory budget however many people visit (services.KeptCaches)."""
        self.services.kept.add(comparison)

    def _save(self, run: RunEntry, snaps, comparison: Comparison) -> str:
        """Complete the run in the log; the status line that says how it went and where it is (or will be)."""
        counts = Counter(snap.status for snap in snaps.values())
        failed = [label for label, snap in snaps.items() if snap.status == "error"]
        summary = f"{counts['done']} of {len(snaps)} methods finished" + \
            (f", {counts['stopped']} stopped" if counts["stopped"] else "") + \
            (f"; failed: {', '.join(failed)} (see their panes)" if failed else "") + "."
        outcome = self.services.runlog.finish(run, snaps, comparison.memory_label)
        link = permalink_html(outcome.slug) if outcome.saved or outcome.waiting else ""
        return status_html("warning" if failed or not outcome.saved else "ok", f"{summary} {outcome.note}", link)

    def redraw(self, session: CompareSession, method, layer, head):
        """The plot selection changed: follow it now and in the running comparison's next redraws."""
        session.view = (method, int(layer), int(head))
        if session.comparison is not None:
            session.comparison.set_focus(method, int(layer))
        return live_figures(session.comparison, *session.view)

    @staticmethod
    def stop(session: CompareSession):
        session.stop()

    def new_chat(self):
        return {**{chat: [] for chat in self.chats.values()},
                **{m: metrics_html(None, "", False) for m in self.metrics.values()},
                self.status: ""}

    @staticmethod
    def show_panes(methods):
        selected = set(methods or [])
        return [gr.update(visible=label in selected) for label in PANE_METHODS] + \
               [gr.update(open=CUSTOM in selected)]


def build(services: Services) -> ComparePage:
    """The tab's components inside the current gr.Tab, with their events wired."""
    model = services.models.default[0]
    text_config = model.config.get_text_config()
    layers, kv_heads = text_config.num_hidden_layers, text_config.num_key_value_heads
    session = gr.State(CompareSession())
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=290, elem_classes="kitty-controls"):
            methods = gr.CheckboxGroup(PANE_METHODS, value=DEFAULT_METHODS, label="Methods",
                                       info="Each one gets its own cache and pane.", elem_id="methods")
            with gr.Accordion("Custom method", open=False) as custom_box:
                with gr.Row():
                    k_bits = gr.Dropdown(list(SUPPORTED_BITS), value=2, label="Key bits", min_width=90)
                    v_bits = gr.Dropdown(list(SUPPORTED_BITS), value=2, label="Value bits", min_width=90)
                alpha = gr.Slider(0, 1, value=0.125, step=0.005, label="Boost fraction α",
                                  info="share of key channels stored at 4 bits (needs 2-bit keys)")
                with gr.Row():
                    sink = gr.Number(32, label="Sink", precision=None, min_width=80)
                    page_size = gr.Number(128, label="Page size", precision=None, min_width=80)
                    window = gr.Number(128, label="Window", precision=None, min_width=80)
                selection = gr.Radio(list(SELECTIONS), value="magnitude", label="Channel selection")
            with gr.Accordion("Generation", open=True):
                max_new_tokens = gr.Number(64, label="Max new tokens", precision=None, elem_id="max-new-tokens",
                                           info=f"1 to {services.config.max_new_tokens_cap}")
                decoding = gr.Radio(["greedy", "sample"], value="greedy", label="Decoding")
                with gr.Group(visible=False) as sampling_box:
                    temperature = gr.Slider(0.05, 2.0, value=0.7, step=0.05, label="Temperature")
                    top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.01, label="Top-p")
                    top_k = gr.Number(50, label="Top-k (0 = off)", precision=None)
                seed = gr.Number(0, label="Seed", precision=None,
                                 info="every method samples with the same seed")
            model_name = gr.Textbox(services.models.default_name, label="Model",
                                    visible=services.config.allow_any_model or bool(services.config.allowed_models),
                                    info="a model the operator allows (README: loading other models); remote "
                                         "code never runs")
        with gr.Column(scale=4):
            panes, chats, metrics = {}, {}, {}
            with gr.Row(elem_classes="kitty-panes"):
                for label in PANE_METHODS:
                    config = method_config(label) if label != CUSTOM else None
                    with gr.Column(visible=label in DEFAULT_METHODS, min_width=300,
                                   elem_classes="kitty-pane", elem_id=f"pane-{_slug(label)}") as panes[label]:
                        gr.HTML(pane_header(label, config))
                        chats[label] = gr.Chatbot(height=360, show_label=False, buttons=["copy"],
                                                  elem_id=f"chat-{_slug(label)}", feedback_options=None,
                                                  placeholder=f"{label}'s answer appears here")
                        metrics[label] = gr.HTML(metrics_html(None, "", False), elem_id=f"metrics-{_slug(label)}")
            gr.Markdown(FOOTNOTE, elem_classes="kitty-footnote")
            with gr.Row(equal_height=True):
                prompt = gr.Textbox(label="Your message", placeholder="Ask something: every method answers it…",
                                    lines=2, max_lines=12, scale=6, elem_id="prompt", autofocus=True)
                with gr.Column(scale=1, min_width=140):
                    send = gr.Button("Send ▶", variant="primary", elem_id="send")
                    with gr.Row():
                        stop = gr.Button("Stop", variant="stop", size="sm", min_width=60, elem_id="stop")
                        clear = gr.Button("New chat", size="sm", min_width=60, elem_id="new-chat")
            status = gr.HTML("", elem_id="compare-status")
            gr.Examples(EXAMPLES, inputs=[prompt], label="Try one (the last is long enough for 2-bit pages)")
            projection_plot = gr.Plot(live_figures(None, "kitty", 0, 0)[4], show_label=False,
                                      elem_id="kv-projection-plot")

    gr.Markdown("### What the caches hold, live\n"
                "**Boost mask**: for every 128-token key page, the channels Kitty keeps at 4 bits (orange), the "
                "ones with the largest mean |k| on that page. **Key magnitudes**: |k| per channel and token as "
                "the cache holds it (pages dequantized). A few channels stand out across all tokens (the "
                "paper's Figure 2a): those are the channels worth protecting.", elem_classes="kitty-plot-intro")
    with gr.Row():
        plot_method = gr.Dropdown(PANE_METHODS, value="kitty", label="Method", scale=1, elem_id="plot-method")
        layer = gr.Slider(0, layers - 1, value=min(10, layers - 1), step=1, label="Layer", scale=2)
        head = gr.Slider(0, kv_heads - 1, value=0, step=1, label="KV head", scale=2)
    with gr.Row():
        mask_plot = gr.Plot(label="Boost mask", elem_id="boost-mask-plot")
        magnitude_plot = gr.Plot(label="Key magnitudes", elem_id="magnitude-plot")
    with gr.Row():
        bytes_plot = gr.Plot(label="KV bytes over time", elem_id="kv-bytes-plot")
        speed_plot = gr.Plot(label="Tokens per second", elem_id="speed-plot")

    page = ComparePage(services, session, prompt, methods,
                       [k_bits, v_bits, alpha, sink, page_size, window, selection],
                       [max_new_tokens, decoding, temperature, top_p, top_k, seed], model_name,
                       [plot_method, layer, head], chats, metrics,
                       [mask_plot, magnitude_plot, bytes_plot, speed_plot, projection_plot], status)

    methods.change(page.show_panes, methods, [*panes.values(), custom_box], queue=False, api_visibility="private")
    decoding.change(lambda mode: gr.update(visible=mode == "sample"), decoding, sampling_box, queue=False,
                    api_visibility="private")
    gr.on([send.click, prompt.submit], page.send, page.send_inputs, page.send_outputs,
          concurrency_id="generate", concurrency_limit=services.config.compare_concurrency,
          show_progress="hidden", api_visibility="private")
    stop.click(page.stop, session, None, queue=False, api_visibility="private")
    clear.click(page.stop, session, None, queue=False, api_visibility="private").then(
        page.new_chat, None, [*chats.values(), *metrics.values(), status], queue=False, api_visibility="private")
    gr.on([plot_method.change, layer.release, head.release], page.redraw, [session, plot_method, layer, head],
          page.figures, show_progress="hidden", api_visibility="private")
    return page


def _slug(label: str) -> str:
    """An HTML id from a method name ('kivi-k2v2*' -> 'kivi-k2v2-star')."""
    return label.replace("*", "-star")


__all__ = ["ComparePage", "CompareSession", "PANE_METHODS", "DEFAULT_METHODS", "build", "history_messages",
           "live_figures"]
