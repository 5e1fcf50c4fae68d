"""HTML snippets of the page: status messages, pane headers and metric cards. Everything a user or the model
wrote is escaped here, because gr.HTML shows markup as is."""
from __future__ import annotations

from html import escape

from backend.engine import REFERENCE, MethodSnapshot, describe_config
from backend.methods import CacheConfig

from .plots import color

# Plain symbols, not emoji: a machine without an emoji font (a projector PC, a kiosk) still draws them
ICONS = {"info": "ℹ", "ok": "✓", "warning": "⚠", "error": "✕", "running": "↻"}


def status_html(kind: str, message: str, extra_html: str = "") -> str:
    """A message box: kind is info, ok, warning, error or running."""
    return (f'<div class="kitty-status kitty-{kind}" role="status"><span class="kitty-icon">{ICONS[kind]}</span> '
            f'<span class="kitty-message">{escape(message)}</span>{extra_html}</div>')


def permalink_html(slug: str) -> str:
    link = f"?run={escape(slug)}"
    return (f' <a class="kitty-permalink" href="{link}" target="_blank">permalink: {link}</a>')


def pane_header(label: str, config: CacheConfig | None) -> str:
    description = describe_config(config) if config is not None else "your settings from the Custom method box"
    return (f'<div class="kitty-pane-head" style="border-color:{color(label)}">'
            f'<span class="kitty-dot" style="background:{color(label)}"></span><b>{escape(label)}</b>'
            f'<div class="kitty-config">{escape(description)}</div></div>')


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


def metrics_html(snap: MethodSnapshot | None, memory_label: str, has_reference: bool) -> str:
    """The metric card under a pane."""
    if snap is None:
        return '<div class="kitty-metrics kitty-idle">Metrics appear here while the answer streams.</div>'
    state = {"waiting": "waiting", "running": "generating…", "done": "done", "stopped": "stopped",
             "error": "failed"}[snap.status]
    rows = [
        _row("decode speed", f"{snap.tokens_per_s:.1f} tok/s" if snap.tokens_per_s else "–",
             "tokens per second after the first token; all methods share the machine while they run"),
        _row("time to first token", f"{snap.ttft_s:.2f} s" if snap.ttft_s is not None else "–",
             "from the start (prompt prefill included) to the first new token"),
        _row("KV cache", fmt_bytes(snap.kv_bytes) if snap.kv_bytes else "–",
             "bytes the stored tokens use: 2-bit pages with their scales and boost lists, full-precision buffers "
             "(sink, last tokens) at 16 bits, page tables"),
        _row("vs FP16", fmt_ratio(snap.kv_ratio), "the same tokens' keys and values at 16 bits"),
        *projection_rows(snap),
        _row("bits / element", f"K {snap.key_bits:.1f} · V {snap.value_bits:.1f}" if snap.key_bits else "–",
             "bits per stored key / value element, buffers and metadata included"),
        _row(memory_label, fmt_bytes(snap.peak_memory_bytes),
             "the whole process: the model and every run in it, this one's methods and other users'; sampled per "
             "token while this method ran"),
    ]
    if has_reference:
        if snap.label == REFERENCE:
            agreement = "reference"
        elif snap.agreement is None:
            agreement = "–"
        else:
            agreement = f"{snap.agreement:.0%} of tokens"
        rows.append(_row("agreement with FP16", agreement, "share of tokens identical to the FP16 answer, "
                                                           "position by position"))
    error = f'<div class="kitty-pane-error">✕ {escape(snap.error)}</div>' if snap.error else ""
    return (f'<div class="kitty-metrics"><div class="kitty-state kitty-state-{snap.status}">{state} · '
            f'{snap.n_tokens} tokens · prompt {snap.prompt_tokens}</div>{error}{"".join(rows)}</div>')


FOOTNOTE = ("Methods generate at the same time on shared hardware, so speeds compare them under equal load, not "
            "alone. Peak memory is the whole process (the model and every run in it), sampled per token. "
            "KV cache sizes count the bytes the stored tokens use; a short chat is mostly 16-bit buffers (the "
            "32-token sink and the newest 128 tokens), so the rows *projected* at 8K, 32K and 128K tokens (exact "
            "arithmetic from the page layout, for one sequence on this model) show what each cache saves on long "
            "contexts.")
