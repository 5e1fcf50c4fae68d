"""The Compare tab, as arena pages work: one prompt (with an optional long document) to every chosen method, the
answers streaming side by side in one row, each scored against FP16's answer by teacher forcing once they finish,
the first token where each parts from FP16 highlighted; regenerate, a blind mode (answers A, B, ... until the
visitor votes) and votes stored with the run; live plots of what the caches hold.

Every method has a fixed pane (shown while it is selected). In a multi-turn chat each method sees its own earlier
answers, as a real deployment of that cache would: the tab's session keeps those conversations, the panes only
show them (with highlights and folded documents). The handler drives a backend.engine.Comparison and redraws text
about seven times a second and plots about once a second.
"""
from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, replace

import gradio as gr
import numpy as np

from backend import memory
from backend.analysis import bundled_text
from backend.engine import (CUSTOM, REFERENCE, Comparison, GenerationSettings, InputError, MethodSnapshot, has_boost,
                            prepare_comparison, resolve_methods)
from backend.methods import METHODS, SELECTIONS, SUPPORTED_BITS, method_config
from storage import VOTE_TIE, RunEntry, StorageError

from . import plots
from .examples import LONG_EXAMPLE
from .render import (FOOTNOTE, LETTERS, document_message, marked_answer, metrics_html, pane_header, permalink_html,
                     status_html)
from .services import Services

log = logging.getLogger(__name__)

PANE_METHODS = [*METHODS, CUSTOM]
DEFAULT_METHODS = ["fp16", "kivi-k2v2", "kitty"]
PLOT_EVERY_S = 1.0                   # plots are heavier than text: redraw them about once a second
TIE = "Tie: no answer is better"
EXAMPLES = [
    [LONG_EXAMPLE.question, LONG_EXAMPLE.document],
    ["Summarize this story opening in two sentences.", bundled_text()[:1600]],
    ["Explain in three sentences why the sky is blue.", ""],
    ["Write a short poem about a cat who guards a library.", ""],
]
EXAMPLE_LABELS = [LONG_EXAMPLE.label, "A story opening to summarize (about 400 tokens: 2-3 key pages)",
                  "Why is the sky blue? (short: no 2-bit page forms)", "A poem (short: no 2-bit page forms)"]
LIVE_TITLES = ("Boost mask", "Key magnitudes", "KV cache size while generating", "Decode speed",
               "KV cache size against context length")


@dataclass
class Request:
    """What one comparison was asked: kept so that Regenerate can ask it again."""

    content: str                     # the user's message as the models get it (document, then question)
    display: str                     # ...and as the panes show it
    methods: list
    custom: dict | None
    settings: GenerationSettings
    model_name: str
    blind: bool


@dataclass
class ShownRun:
    """The comparison on screen: its methods in the order shown (A, B, ... in blind mode), its run id once saved,
    and whether this tab voted on it."""

    labels: list
    order: list
    blind: bool
    slug: str | None = None
    voted: bool = False

    @property
    def hidden(self) -> bool:
        """Blind mode before the vote: the methods stay behind their letters."""
        return self.blind and not self.voted

    def letter(self, label: str) -> str:
        return LETTERS[self.order.index(label)]


class CompareSession:
    """One browser tab's state (a gr.State): each method's conversation, the latest comparison (kept after it ends so
    that the plots can be redrawn for any method, layer and head), the plot selection the streaming handler
    follows, the last request (for Regenerate) and the run on screen (for blind mode and the vote)."""

    def __init__(self):
        self.comparison: Comparison | None = None
        self.view: tuple[str, int, int] = ("kitty", 10, 0)
        self.history: dict[str, list[dict]] = {}
        self.request: Request | None = None
        self.run: ShownRun | None = None

    def stop(self) -> None:
        if self.comparison is not None:
            self.comparison.stop()


def _text(content) -> str:
    """A chat message's text: Gradio hands content back as a list of parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def answer_message(snap: MethodSnapshot, mark: bool) -> dict:
    """A pane's answer; `mark`: highlight its first token that differs from FP16's answer."""
    if snap.status == "error":
        return {"role": "assistant", "content": snap.text + ("\n\n" if snap.text else "") + f"✕ {snap.error}",
                "metadata": {"title": "This method failed"}}
    if not snap.text:
        return {"role": "assistant", "content": "…" if snap.status in ("waiting", "running") else "(no tokens)"}
    return {"role": "assistant", "content": marked_answer(snap.text, snap.divergence_chars) if mark else snap.text}


def _drop_last_turn(messages: list | None) -> list:
    """A chat without its last user message and what followed it."""
    messages = list(messages or [])
    users = [i for i, message in enumerate(messages) if message.get("role") == "user"]
    return messages[:users[-1]] if users else messages


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


def read_document(path: str | None, max_chars: int) -> str:
    """An uploaded text file's text, within the server's character limit (checked on its size before reading: a
    UTF-8 character takes at most 4 bytes); InputError for a binary file or one that is too long."""
    if not path:
        raise InputError("No file was uploaded.")
    name = os.path.basename(path)
    if os.path.getsize(path) > 4 * max_chars:
        raise InputError(f"{name} is {os.path.getsize(path):,} bytes: this server takes documents of at most "
                         f"{max_chars:,} characters (the conversation's limit).")
    try:
        with open(path, encoding="utf-8-sig") as file:
            text = file.read()
    except UnicodeDecodeError:
        raise InputError(f"{name} is not a UTF-8 text file: upload plain text (.txt, .md, ...).") from None
    if "\x00" in text:
        raise InputError(f"{name} looks like a binary file: upload plain text (.txt, .md, ...).")
    if len(text) > max_chars:
        raise InputError(f"{name} has {len(text):,} characters: this server takes at most {max_chars:,} (the "
                         f"conversation's limit).")
    if not text.strip():
        raise InputError(f"{name} is empty.")
    return text


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
        return [plots.empty_figure(title, "Run a comparison to see this plot.") for title in LIVE_TITLES]
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
    document: gr.Textbox
    methods: gr.CheckboxGroup
    blind: gr.Checkbox
    focus: gr.Dropdown
    custom: list                     # k_bits, v_bits, alpha, sink, page_size, window, selection
    generation: list                 # max_new_tokens, decoding, temperature, top_p, top_k, seed
    model_name: gr.Textbox
    plot_controls: list              # method, layer, head
    panes: dict                      # method -> gr.Column
    headers: dict                    # method -> gr.HTML
    chats: dict                      # method -> gr.Chatbot
    metrics: dict                    # method -> gr.HTML
    figures: list                    # boost mask, magnitudes, kv bytes, speed, kv bytes against context length
    live_box: gr.Column              # the plots: hidden in blind mode until the vote (they name the methods)
    vote_box: gr.Column
    vote_choice: gr.Radio
    vote_status: gr.HTML
    status: gr.HTML

    @property
    def send_inputs(self) -> list:
        return [self.session, self.prompt, self.methods, *self.custom, *self.generation, self.model_name,
                *self.plot_controls, *self.chats.values(), self.document, self.blind]

    @property
    def send_outputs(self) -> list:
        return [self.status, self.prompt, self.document, self.plot_controls[0], self.focus, self.generation[5],
                *self.panes.values(), *self.headers.values(), *self.chats.values(), *self.metrics.values(),
                *self.figures, self.live_box, self.vote_box, self.vote_choice, self.vote_status]

    # -------------------------------------------------------------------- handlers
    def send(self, session: CompareSession, prompt, methods, k_bits, v_bits, alpha, sink, page_size, window,
             selection, max_new_tokens, decoding, temperature, top_p, top_k, seed, model_name, plot_method, layer,
             head, *panes):
        """Run the comparison, streaming every pane; the last update says whether the run was saved. `panes`: the
        chat of every pane (PANE_METHODS order), then the document to ask about and the blind flag (optional)."""
        chats = dict(zip(PANE_METHODS, panes))
        document, blind = (list(panes[len(PANE_METHODS):]) + ["", False])[:2]
        question, document = (prompt or "").strip(), (document or "").strip()
        try:
            settings = generation_settings(max_new_tokens, decoding, temperature, top_p, top_k, seed)
            custom = custom_settings(k_bits, v_bits, alpha, sink, page_size, window, selection) \
                if CUSTOM in (methods or []) else None
        except InputError as exc:
            yield {self.status: status_html("error", str(exc))}
            return
        with_document = bool(document and question)      # no question: the engine's "the prompt is empty"
        request = Request(f"{document}\n\n{question}" if with_document else question,
                          document_message(document, question) if with_document else question,
                          list(methods or []), custom, settings, model_name, bool(blind))
        yield from self._compare(session, request, chats, plot_method, layer, head)

    def regenerate(self, session: CompareSession, plot_method, layer, head, *chats):
        """The last message again, with the same methods and settings (a new seed when sampling), in place of
        the last answers."""
        request = session.request
        if request is None:
            yield {self.status: status_html("error", "Nothing to regenerate yet: send a message first.")}
            return
        if request.settings.sample:
            request = replace(request, settings=replace(request.settings, seed=(request.settings.seed + 1)))
        session.stop()
        session.history = {label: _drop_last_turn(messages) for label, messages in session.history.items()}
        chats = {label: _drop_last_turn(chat) for label, chat in zip(PANE_METHODS, chats)}
        yield from self._compare(session, request, chats, plot_method, layer, head)

    def _compare(self, session: CompareSession, request: Request, chats: dict, plot_method, layer, head):
        try:
            configs = resolve_methods(request.methods, request.custom)
            if self.services.models.needs_loading(request.model_name):
                yield {self.status: status_html("running", f"Loading {request.model_name.strip()} (first use "
                                                           f"only)…")}
            model, tokenizer = self.services.models.get(request.model_name)
            user = {"role": "user", "content": request.content}
            conversations = {label: session.history.get(label, []) + [user] for label in configs}
            comparison = prepare_comparison(model, tokenizer, conversations, configs, request.settings,
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
        order = random.sample(labels, len(labels)) if request.blind else labels
        session.comparison, session.view = comparison, (method, int(layer), int(head))
        shown_run = ShownRun(labels, order, request.blind)
        session.request, session.run = request, shown_run
        comparison.set_focus(method, int(layer))
        shown = {label: list(chats[label] or []) + [{"role": "user", "content": request.display}] for label in labels}
        has_reference = REFERENCE in labels
        run = self.services.runlog.begin(model.kitty_model_name, conversations[labels[0]], request.settings, labels)
        comparison.start()
        last_plot, finished = 0.0, False
        try:
            yield {self.status: status_html("running", f"Generating with {len(labels)} methods at the same time…"),
                   self.prompt: "", self.document: "", self.generation[5]: request.settings.seed,
                   self.plot_controls[0]: gr.update(choices=labels, value=method),
                   self.vote_box: gr.update(visible=False), self.vote_status: "",
                   **self._arrangement(shown_run)}
            for snaps in comparison.updates():
                update = {self.chats[label]: shown[label] + [answer_message(snap, has_reference and
                                                                            not shown_run.hidden)]
                          for label, snap in snaps.items()}
                update.update({self.metrics[label]: metrics_html(snap, comparison.memory_label, has_reference,
                                                                 shown_run.hidden)
                               for label, snap in snaps.items()})
                if not shown_run.hidden and (time.perf_counter() - last_plot >= PLOT_EVERY_S
                                               or comparison.finished):
                    last_plot = time.perf_counter()
                    update.update(zip(self.figures, live_figures(comparison, *session.view)))
                yield update
            finished = True
            if session.comparison is comparison:     # not overtaken by a newer comparison of this tab (Regenerate)
                for label, snap in snaps.items():
                    session.history[label] = conversations[label] + \
                        ([] if snap.status == "error" else [{"role": "assistant", "content": snap.text}])
            self._keep(comparison)
            yield self._save(shown_run, run, snaps, comparison)
        finally:
            if not finished:             # the page went away mid-run (Gradio closed this generator)
                self.services.runlog.abandon(run, comparison)

    def _arrangement(self, shown: ShownRun | None, reorder: bool = True) -> dict:
        """Pane order (unless not `reorder`), titles and what blind mode hides: blind panes are shuffled behind
        their letters."""
        update = {}
        for position, label in enumerate(PANE_METHODS):
            config = method_config(label) if label != CUSTOM else None
            if shown is not None and shown.blind and label in shown.labels:
                position = shown.order.index(label)
            if reorder:
                update[self.panes[label]] = gr.update(elem_classes=["kitty-pane", f"kitty-order-{position}"])
            if shown is not None and label in shown.labels:
                update[self.headers[label]] = pane_header(label, config, shown.letter(label) if shown.blind else None,
                                                          hidden=shown.hidden)
            else:
                update[self.headers[label]] = pane_header(label, config)
        hidden = shown is not None and shown.hidden
        update[self.live_box] = gr.update(visible=not hidden)
        update[self.focus] = gr.update(interactive=False, value=[]) if hidden else gr.update(interactive=True)
        return update

    def _keep(self, comparison: Comparison) -> None:
        """Caches hold every key and value: an idle tab's plots can still explore any layer of the latest
        comparisons, within the operator's memory budget however many people visit (services.KeptCaches)."""
        self.services.kept.add(comparison)

    def _save(self, shown: ShownRun, run: RunEntry, snaps, comparison: Comparison) -> dict:
        """Complete the run in the log; the status line that says how it went and where it is (or will be), and
        the vote that a saved run can take."""
        counts = Counter(snap.status for snap in snaps.values())
        failed = [label for label, snap in snaps.items() if snap.status == "error"]
        outcome = self.services.runlog.finish(run, snaps, comparison.memory_label)
        link = permalink_html(outcome.slug) if outcome.saved or outcome.waiting else ""
        complete = f"{counts['done']} of {len(snaps)} answers complete"
        if comparison.stopped:
            cut = [label for label, snap in snaps.items() if "stopped" in (snap.status, snap.score_status)]
            summary = (f"Stopped: {complete}; cut short: {', '.join(cut) if not shown.hidden else len(cut)}"
                       if cut else f"Stopped after every answer was complete and scored ({complete})")
            kind = "stopped"
        else:
            summary = f"{complete}" + (f"; failed: {', '.join(failed)} (see their panes)" if failed else "")
            kind = "warning" if failed or not outcome.saved else "ok"
        shown.slug = outcome.slug if outcome.saved else None
        choices = [*(LETTERS[:len(shown.order)] if shown.blind else shown.order), TIE]
        prompt = ("Which answer is better? Your vote is stored with the run; the methods are revealed after it."
                  if shown.blind else "Which answer is better? Your vote is stored with the run.")
        return {self.status: status_html(kind, f"{summary}. {outcome.note}", link),
                self.vote_box: gr.update(visible=outcome.saved),
                self.vote_choice: gr.update(choices=choices, value=None, label=prompt)}

    def vote(self, session: CompareSession, choice):
        """Store the visitor's preference with the run on screen; blind mode then reveals the methods."""
        shown = session.run
        if shown is None or shown.slug is None:
            return {self.vote_status: status_html("error", "Vote on a finished, saved comparison.")}
        if shown.voted:
            return {self.vote_status: status_html("info", "You already voted on this run.")}
        if choice not in ([*LETTERS[:len(shown.order)], TIE] if shown.blind else [*shown.order, TIE]):
            return {self.vote_status: status_html("error", "Choose an answer (or a tie) first.")}
        method = VOTE_TIE if choice == TIE else shown.order[LETTERS.index(choice)] if shown.blind else choice
        try:
            self.services.runlog.vote(shown.slug, method, blind=shown.blind, shown=shown.order)
        except StorageError as exc:
            log.warning("vote on %s: %s", shown.slug, exc)
            return {self.vote_status: status_html("warning", f"The vote was not stored ({exc.reason}). Try again.")}
        shown.voted = True
        what = "a tie" if method == VOTE_TIE else (f"{choice} = {method}" if shown.blind else method)
        reveal = ("; the methods: " + ", ".join(f"{LETTERS[i]} = {label}" for i, label in enumerate(shown.order))
                  if shown.blind else "")
        update = {self.vote_status: status_html("ok", f"Vote stored: {what}{reveal}. The leaderboard is in the "
                                                      f"History tab."),
                  self.vote_box: gr.update(visible=True), **self._arrangement(shown, reorder=False)}
        comparison = session.comparison
        if shown.blind and comparison is not None:       # what blind mode held back
            snaps = comparison.snapshots()
            has_reference = REFERENCE in snaps
            for label, snap in snaps.items():
                update[self.metrics[label]] = metrics_html(snap, comparison.memory_label, has_reference)
            update.update(zip(self.figures, live_figures(comparison, *session.view)))
        return update

    def mark_answers(self, session: CompareSession, *chats):
        """After a blind vote: the panes' last answers with their first token that differs from FP16's."""
        comparison = session.comparison
        if comparison is None or session.run is None or session.run.hidden:
            return [gr.update() for _ in PANE_METHODS]
        snaps = comparison.snapshots()
        mark = REFERENCE in snaps
        return [list(chat[:-1]) + [answer_message(snaps[label], mark)] if label in snaps and chat else gr.update()
                for label, chat in zip(PANE_METHODS, chats)]

    def redraw(self, session: CompareSession, method, layer, head):
        """The plot selection changed: follow it now and in the running comparison's next redraws."""
        session.view = (method, int(layer), int(head))
        if session.comparison is not None:
            session.comparison.set_focus(method, int(layer))
        return live_figures(session.comparison, *session.view)

    @staticmethod
    def stop(session: CompareSession):
        session.stop()

    def new_chat(self, session: CompareSession):
        """A fresh start: no conversation, no answers, no plots of the last run."""
        session.stop()
        session.comparison, session.history, session.request, session.run = None, {}, None, None
        return {**{chat: [] for chat in self.chats.values()},
                **{m: metrics_html(None, "", False) for m in self.metrics.values()},
                **dict(zip(self.figures, live_figures(None, "", 0, 0))), **self._arrangement(None),
                self.status: "", self.document: "", self.vote_box: gr.update(visible=False), self.vote_status: ""}

    @staticmethod
    def focus_panes(methods, focus) -> list:
        """The selected methods' panes; with two of them in focus, only those two (a close read)."""
        selected = [label for label in PANE_METHODS if label in (methods or [])]
        focus = [label for label in focus or [] if label in selected]
        shown = focus if len(focus) == 2 else selected
        return [gr.update(visible=label in shown) for label in PANE_METHODS]

    def show_panes(self, methods, focus) -> list:
        """The panes of the methods now selected, the custom settings open when custom is, and the focus
        choices: the selected methods."""
        selected = [label for label in PANE_METHODS if label in (methods or [])]
        focus = [label for label in focus or [] if label in selected]
        return self.focus_panes(methods, focus) + [gr.update(open=CUSTOM in selected),
                                                   gr.update(choices=selected, value=focus)]

    def load_document(self, path):
        """An uploaded text file into the document box (checked against the conversation's limit)."""
        try:
            text = read_document(path, self.services.config.limits.max_chars)
        except InputError as exc:
            return gr.update(), status_html("error", str(exc))
        return text, status_html("info", f"Loaded {os.path.basename(path)} ({len(text):,} characters): type your "
                                         f"question and send it.")


def build(services: Services) -> ComparePage:
    """The tab's components inside the current gr.Tab, with their events wired."""
    model = services.models.default[0]
    text_config = model.config.get_text_config()
    layers, kv_heads = text_config.num_hidden_layers, text_config.num_key_value_heads
    session = gr.State(CompareSession())
    with gr.Row(equal_height=False, elem_classes="kitty-compare"):
        with gr.Column(scale=1, min_width=250, elem_classes="kitty-controls"):
            methods = gr.CheckboxGroup(PANE_METHODS, value=DEFAULT_METHODS, label="Methods",
                                       info="Each one gets its own cache and pane.", elem_id="methods")
            blind = gr.Checkbox(False, label="Blind: answers as A, B, … until you vote", elem_id="blind")
            focus = gr.Dropdown(DEFAULT_METHODS, value=[], multiselect=True, max_choices=2, label="Focus two",
                                info="pick two methods for a close read", elem_id="focus")
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
                seed = gr.Number(0, label="Seed", precision=None, elem_id="seed",
                                 info="every method samples with the same seed; Regenerate takes the next one")
            model_name = gr.Textbox(services.models.default_name, label="Model",
                                    visible=services.config.allow_any_model or bool(services.config.allowed_models),
                                    info="a model the operator allows (README: loading other models); remote "
                                         "code never runs")
        with gr.Column(scale=4, elem_classes="kitty-main"):
            panes, headers, chats, metrics = {}, {}, {}, {}
            with gr.Row(elem_classes="kitty-panes", elem_id="panes"):
                for position, label in enumerate(PANE_METHODS):
                    config = method_config(label) if label != CUSTOM else None
                    with gr.Column(visible=label in DEFAULT_METHODS, min_width=200,
                                   elem_classes=["kitty-pane", f"kitty-order-{position}"],
                                   elem_id=f"pane-{_slug(label)}") as panes[label]:
                        headers[label] = gr.HTML(pane_header(label, config), elem_id=f"head-{_slug(label)}")
                        chats[label] = gr.Chatbot(height=340, show_label=False, buttons=["copy"],
                                                  elem_id=f"chat-{_slug(label)}", feedback_options=None,
                                                  placeholder=f"{label}'s answer appears here")
                        metrics[label] = gr.HTML(metrics_html(None, "", False), elem_id=f"metrics-{_slug(label)}")
            with gr.Column(visible=False, elem_id="vote-box", elem_classes="kitty-vote") as vote_box:
                with gr.Row(equal_height=False):
                    vote_choice = gr.Radio([], label="Which answer is better?", scale=4, elem_id="vote-choice")
                    vote_button = gr.Button("Vote", variant="primary", scale=1, min_width=100, elem_id="vote")
                vote_status = gr.HTML("", elem_id="vote-status")
            with gr.Row(equal_height=True, elem_classes="kitty-ask"):
                prompt = gr.Textbox(label="Your message", placeholder="Ask something: every method answers it…",
                                    lines=2, max_lines=8, scale=6, elem_id="prompt", autofocus=True)
                with gr.Column(scale=1, min_width=150):
                    send = gr.Button("Send ▶", variant="primary", elem_id="send")
                    with gr.Row():
                        regenerate = gr.Button("Regenerate", size="sm", min_width=70, elem_id="regenerate")
                        stop = gr.Button("Stop", variant="stop", size="sm", min_width=50, elem_id="stop")
                        clear = gr.Button("New chat", size="sm", min_width=70, elem_id="new-chat")
            with gr.Accordion("Long document: paste or upload a text to ask about", open=False,
                              elem_id="document-box") as document_box:
                document = gr.Textbox(label="Document", lines=4, max_lines=10, elem_id="document",
                                      placeholder="Paste a long text here; your message is the question about it.",
                                      info=f"sent before your message; together at most "
                                           f"{services.config.limits.max_chars:,} characters")
                upload = gr.UploadButton("Upload a text file", file_types=[".txt", ".md", ".csv", ".json", ".log"],
                                         size="sm", elem_id="upload")
            status = gr.HTML("", elem_id="compare-status")
            gr.Examples(EXAMPLES, inputs=[prompt, document], example_labels=EXAMPLE_LABELS,
                        label="Try one (the first two are long enough for 2-bit pages)", elem_id="examples")
            gr.Markdown(FOOTNOTE, elem_classes="kitty-footnote")

    with gr.Column(elem_id="live-plots") as live_box:
        gr.Markdown("### What the caches hold, live\n"
                    "**Boost mask**: for every 128-token key page, the channels Kitty keeps at 4 bits (orange), the "
                    "ones with the largest mean |k| on that page. **Key magnitudes**: |k| per channel and token as "
                    "the cache holds it (pages dequantized). A few channels stand out across all tokens (the "
                    "paper's Figure 2a): those are the channels worth protecting.", elem_classes="kitty-plot-intro")
        with gr.Row():
            plot_method = gr.Dropdown(PANE_METHODS, value="kitty", label="Method", scale=1, elem_id="plot-method")
            layer = gr.Slider(0, layers - 1, value=min(10, layers - 1), step=1, label="Layer", scale=2)
            head = gr.Slider(0, kv_heads - 1, value=0, step=1, label="KV head", scale=2)
        empty = live_figures(None, "", 0, 0)
        with gr.Row():
            mask_plot = gr.Plot(empty[0], show_label=False, elem_id="boost-mask-plot")
            magnitude_plot = gr.Plot(empty[1], show_label=False, elem_id="magnitude-plot")
        with gr.Row():
            bytes_plot = gr.Plot(empty[2], show_label=False, elem_id="kv-bytes-plot")
            speed_plot = gr.Plot(empty[3], show_label=False, elem_id="speed-plot")
        projection_plot = gr.Plot(empty[4], show_label=False, elem_id="kv-projection-plot")

    page = ComparePage(services, session, prompt, document, methods, blind, focus,
                       [k_bits, v_bits, alpha, sink, page_size, window, selection],
                       [max_new_tokens, decoding, temperature, top_p, top_k, seed], model_name,
                       [plot_method, layer, head], panes, headers, chats, metrics,
                       [mask_plot, magnitude_plot, bytes_plot, speed_plot, projection_plot], live_box, vote_box,
                       vote_choice, vote_status, status)

    private = dict(queue=False, show_progress="hidden", api_visibility="private")
    methods.change(page.show_panes, [methods, focus], [*panes.values(), custom_box, focus], **private)
    focus.input(page.focus_panes, [methods, focus], list(panes.values()), **private)   # the visitor's pick only
    decoding.change(lambda mode: gr.update(visible=mode == "sample"), decoding, sampling_box, **private)
    generate = dict(concurrency_id="generate", concurrency_limit=services.config.compare_concurrency,
                    show_progress="hidden", api_visibility="private")
    gr.on([send.click, prompt.submit], page.send, page.send_inputs, page.send_outputs, **generate)
    regenerate.click(page.regenerate, [session, *page.plot_controls, *chats.values()], page.send_outputs, **generate)
    stop.click(page.stop, session, None, **private)
    clear.click(page.new_chat, session, [*chats.values(), *metrics.values(), *page.figures, *panes.values(),
                                         *headers.values(), live_box, focus, status, document, vote_box, vote_status],
                **private)
    vote_button.click(page.vote, [session, vote_choice],
                      [vote_status, vote_box, live_box, focus, *headers.values(), *metrics.values(), *page.figures],
                      show_progress="hidden", api_visibility="private").then(
        page.mark_answers, [session, *chats.values()], list(chats.values()), **private)
    upload.upload(page.load_document, upload, [document, status], api_visibility="private")
    document.change(lambda text: gr.update(open=True) if text else gr.update(), document, document_box, **private)
    gr.on([plot_method.change, layer.release, head.release], page.redraw, [session, plot_method, layer, head],
          page.figures, show_progress="hidden", api_visibility="private")
    return page


def _slug(label: str) -> str:
    """An HTML id from a method name ('kivi-k2v2*' -> 'kivi-k2v2-star')."""
    return label.replace("*", "-star")


__all__ = ["ComparePage", "CompareSession", "PANE_METHODS", "DEFAULT_METHODS", "build", "live_figures",
           "read_document"]
