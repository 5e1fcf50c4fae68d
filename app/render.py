"""HTML snippets of the page: status messages, pane headers and metric cards. Everything a user or the model
wrote is escaped here, because gr.HTML shows markup as is."""
from __future__ import annotations

from html import escape

from backend.engine import REFERENCE, MethodSnapshot, describe_config
from backend.methods import CacheConfig

from .plots import color

# Plain symbols, not emoji: a machine without an emoji font (a projector PC, a kiosk) still draws them
ICONS = {"info": "ℹ", "ok": "✓", "warning": "⚠", "error": "✕", "running": "↻", "stopped": "■"}
LETTERS = "ABCDEFGHIJ"               # blind mode: answers are A, B, ... until the vote


def status_html(kind: str, message: str, extra_html: str = "") -> str:
    """A message box: kind is info, ok, warning, error, running or stopped."""
    return (f'<div class="kitty-status kitty-{kind}" role="status"><span class="kitty-icon">{ICONS[kind]}</span> '
            f'<span class="kitty-message">{escape(message)}</span>{extra_html}</div>')


def permalink_html(slug: str) -> str:
    link = f"?run={escape(slug)}"
    return (f' <a class="kitty-permalink" href="{link}" target="_blank">permalink: {link}</a>')


def pane_header(label: str, config: CacheConfig | None, letter: str | None = None, hidden: bool = False) -> str:
    """A pane's title: the method and its settings; in blind mode its letter, and the method only once revealed."""
    if hidden:
        return (f'<div class="kitty-pane-head kitty-blind-head"><span class="kitty-dot"></span><b>Answer {letter}</b>'
                f'<div class="kitty-config">the method stays hidden until you vote</div></div>')
    description = describe_config(config) if config is not None else "your settings from the Custom method box"
    name = f"{letter} · {label}" if letter else label
    return (f'<div class="kitty-pane-head" style="border-color:{color(label)}">'
            f'<span class="kitty-dot" style="background:{color(label)}"></span><b>{escape(name)}</b>'
            f'<div class="kitty-config">{escape(description)}</div></div>')


def marked_answer(text: str, span: tuple[int, int] | list[int] | None, html: bool = False) -> str:
    """An answer with its first token that differs from FP16's answer highlighted; the text is escaped around the
    mark, so only the mark is markup. Without a mark the text stays as it is for a chat pane (which renders it as
    Markdown), escaped for an HTML block (`html`)."""
    if not span or not 0 <= span[0] < span[1] <= len(text):
        return escape(text) if html else text
    first, last = span
    return (f'{escape(text[:first])}<mark class="kitty-diverge" title="first token that differs from the FP16 '
            f'answer">{escape(text[first:last])}</mark>{escape(text[last:])}')


def document_message(document: str, question: str) -> str:
    """How a question about a pasted or uploaded document shows in the panes: the document folded away."""
    return (f'<details class="kitty-document"><summary>document · {len(document):,} characters</summary>'
            f'<div class="kitty-document-text">{escape(document)}</div></details>\n\n{escape(question)}')


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def fmt_ratio(ratio: float | None) -> str:
    """KV bytes against FP16: '27% of FP16' up to FP16's size, '1.2× FP16' above."""
    if ratio is None:
        return "–"
    return f"{ratio:.0%} of FP16" if ratio < 1.005 else f"{ratio:.1f}× FP16"


def _row(name: str, value: str, hint: str = "") -> str:
    title = f' title="{escape(hint)}"' if hint else ""
    return f'<div class="kitty-metric"{title}><span>{escape(name)}</span><b>{escape(value)}</b></div>'


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def projection_rows(snap: MethodSnapshot) -> list[str]:
    """What the same cache would use at long contexts (backend.memory's arithmetic from the layout)."""
    return [_row(f"at {fmt_tokens(tokens)} tokens (projected)", f"{fmt_bytes(used)} · {fmt_ratio(used / fp16)}",
                 f"exact arithmetic from the page layout: one sequence of {tokens:,} tokens on this model; FP16 "
                 f"would use {fmt_bytes(fp16)}") for tokens, used, fp16 in snap.projection]


def fmt_token(token: str | None) -> str:
    return "–" if token is None else repr(token)


def quality_rows(snap: MethodSnapshot) -> list[str]:
    """How close the answer is to FP16's: FP16's answer fed through this cache (teacher forcing), then the
    free-running token match, a secondary figure since two answers part for good at their first different token."""
    if snap.label == REFERENCE:
        forced = [_row("quality (teacher-forced)", "reference", "the other methods are scored against this answer")]
    elif snap.score_status == "scored":
        score = snap.score
        first = "none: same top-1 everywhere" if score.first_difference is None else (
            f"token {score.first_difference + 1}: {fmt_token(score.method_token)} for {fmt_token(score.fp16_token)}")
        forced = [
            _row("top-1 agreement (teacher-forced)", f"{score.top1_agreement:.0%} of {score.positions}",
                 "FP16's answer fed through this cache token by token: the share of positions where this cache's "
                 "most likely next token is FP16's"),
            _row("KL from FP16 (teacher-forced)", f"{score.kl:.3g} nats/token",
                 "mean KL(FP16 || this cache) over FP16's answer: 0 = the same predictions"),
            _row("first different choice", first, "the first token of FP16's answer where this cache would have "
                                                  "chosen another token (its choice for FP16's)"),
        ]
    else:
        value = {"pending": "after the answers finish", "scoring": snap.score_note or "scoring…"}.get(
            snap.score_status, f"– ({snap.score_note})" if snap.score_note else "–")
        forced = [_row("quality (teacher-forced)", value, "FP16's answer fed through this cache once every answer "
                                                          "is complete")]
    if snap.label == REFERENCE:
        match = "reference"
    elif snap.agreement is None:
        match = "–"
    else:
        match = f"{snap.agreement:.0%} of tokens"
    return forced + [_row("free-running token match", match, "share of tokens identical to FP16's own answer, "
                                                             "position by position: after the first different "
                                                             "token two answers rarely meet again, so this ranks "
                                                             "methods by luck (a stopped answer counts its tokens "
                                                             "only)")]


def metrics_html(snap: MethodSnapshot | None, memory_label: str, has_reference: bool, hidden: bool = False) -> str:
    """The metric card under a pane; `hidden` (blind mode before the vote) keeps only what reveals no method."""
    if snap is None:
        return '<div class="kitty-metrics kitty-idle">Metrics appear here while the answer streams.</div>'
    state = {"waiting": "waiting", "running": "generating…", "done": "done", "stopped": "stopped",
             "error": "failed"}[snap.status]
    if snap.status == "done" and snap.score_status == "scoring":
        state = "done · scoring against FP16…"
    head = (f'<div class="kitty-state kitty-state-{snap.status}">{state} · {snap.n_tokens} tokens · prompt '
            f'{snap.prompt_tokens}</div>')
    error = f'<div class="kitty-pane-error">✕ {escape(snap.error)}</div>' if snap.error else ""
    if hidden:
        return (f'<div class="kitty-metrics">{head}{error}<div class="kitty-idle">Metrics are hidden until you vote '
                f'(they would tell the methods apart).</div></div>')
    rows = [
        *(quality_rows(snap) if has_reference else []),
        _row("decode speed", f"{snap.tokens_per_s:.1f} tok/s" if snap.tokens_per_s else "–",
             "tokens per second after the first token; all methods share the machine while they run"),
        _row("time to first token", f"{snap.ttft_s:.2f} s" if snap.ttft_s is not None else "–",
             "from the start (prompt prefill included) to the first new token"),
        _row("KV cache", fmt_bytes(snap.kv_bytes) if snap.kv_bytes else "–",
             "bytes the stored tokens use: 2-bit pages with their scales and boost lists, full-precision buffers "
             "(sink, last tokens) at 16 bits, page tables"),
        _row("vs FP16", fmt_ratio(snap.kv_ratio), "the same tokens' keys and values at 16 bits"),
        _row("quantized pages", f"{snap.key_pages:,} key · {snap.value_pages:,} value",
             "pages formed so far, all layers together: a key page every 128 tokens after the sink"),
        *projection_rows(snap),
        _row("bits / element", f"K {snap.key_bits:.1f} · V {snap.value_bits:.1f}" if snap.key_bits else "–",
             "bits per stored key / value element, buffers and metadata included"),
        _row(memory_label, fmt_bytes(snap.peak_memory_bytes),
             "the whole process: the model and every run in it, this one's methods and other users'; sampled per "
             "token while this method ran"),
    ]
    return f'<div class="kitty-metrics">{head}{error}{"".join(rows)}</div>'


FOOTNOTE = ("Methods generate at the same time on shared hardware, so speeds compare them under equal load, not "
            "alone. Peak memory is the whole process (the model and every run in it), sampled per token. "
            "KV cache sizes count the bytes the stored tokens use; a short chat is mostly 16-bit buffers (the "
            "32-token sink and the newest 128 tokens), so the rows *projected* at 8K, 32K and 128K tokens (exact "
            "arithmetic from the page layout, for one sequence on this model) show what each cache saves on long "
            "contexts.")
