"""The whole page (tabs, the JSON API, permalinks) and how it is served.

Queueing: every event goes through Gradio's queue. Comparisons (the Send button and the /compare API) share
the "generate" group, at most `compare_concurrency` at once; teaching runs have their own "teaching" group; all
other events (history, plot redraws, page loads) use the default limit, so they never wait behind a generation.
"""
from __future__ import annotations

import logging

import gradio as gr
import torch

from . import api, compare_tab, history_tab, insights_tab, teaching_tab
from .config import AppConfig, parse_args
from .services import Services
from .style import CSS, THEME

API_DOC = """### Use Kitty Lab from Python
The `/compare` endpoint runs one comparison to the end and returns every method's answer and metrics as JSON
(it is logged to the history like a comparison from this page):
```python
from gradio_client import Client

client = Client("{url}")
result = client.predict(
    "Why is the sky blue?",                      # prompt
    ["fp16", "kivi-k2v2", "kitty"],              # methods (add "custom" and settings["custom"] for your own)
    '{{"max_new_tokens": 32, "seed": 0}}',         # settings as JSON
    api_name="/compare",
)
print(result["run_slug"], result["permalink"])
for method, answer in result["results"].items():
    print(method, answer["tokens_per_s"], answer["kv_ratio"], answer["top1_agreement"], answer["kl_from_fp16"],
          answer["text"][:60])
```
`top1_agreement`, `kl_from_fp16` and `first_difference` score each answer against FP16's by teacher forcing
(FP16's answer fed through the method's cache; `score_status` says how it went); `agreement` is the free-running
token match. Settings keys: `max_new_tokens`, `sample` (true/false), `temperature`, `top_p`, `top_k`, `seed`, `custom`
(`k_bits`, `v_bits`, `sink`, `page_size`, `local_window`, `alpha`, `selection`), `history` (earlier
`{{"role", "content"}}` messages) and, where the operator allows it, `model`. A bad request raises an error
with the same message the page shows."""


def header_html(services: Services) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return (f'<div class="kitty-title"><h1>🐱 Kitty Lab</h1><p>One prompt, several KV caches side by side: FP16, '
            f'KIVI and Kitty (2-bit keys with the most important channels boosted to 4 bits). Model: '
            f'<b>{services.models.default_name}</b> on <b>{device}</b>.</p></div>')


def build_app(services: Services) -> gr.Blocks:
    # No analytics: the page may run where nothing outside can be reached, and it has no reason to report usage
    with gr.Blocks(title="Kitty Lab: KV cache comparison", analytics_enabled=False) as demo:
        gr.HTML(header_html(services))
        with gr.Tabs(elem_id="tabs") as tabs:
            with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
                compare_tab.build(services)
            with gr.Tab("History", id="history", elem_id="tab-history") as history_tab_:
                history = history_tab.build(services)
            with gr.Tab("Teaching", id="teaching", elem_id="tab-teaching"):
                teaching_tab.build(services)
            with gr.Tab("Insights", id="insights", elem_id="tab-insights"):
                insights_tab.build(services)
            with gr.Tab("API", id="api", elem_id="tab-api"):
                gr.Markdown(API_DOC.format(url=f"http://{services.config.host}:{services.config.port}/"))
        gr.api(api.make_compare(services), api_name="compare", concurrency_id="generate",
               concurrency_limit=services.config.compare_concurrency)
        history_tab_.select(history.search, history.filters, history.search_outputs, api_visibility="private")

        def open_permalink(request: gr.Request):
            """/?run=<slug> opens the History tab on that run."""
            slug = request.query_params.get("run") if request else None
            if not slug:
                return [gr.update()] * (1 + len(history.view_outputs))
            return [gr.Tabs(selected="history"), *history.open_run(slug)]

        demo.load(open_permalink, None, [tabs, *history.view_outputs], api_visibility="private")
    demo.queue(default_concurrency_limit=services.config.default_concurrency)
    return demo


def launch(demo: gr.Blocks, config: AppConfig, **kwargs):
    return demo.launch(server_name=config.host, server_port=config.port, share=config.share, theme=THEME, css=CSS,
                       **kwargs)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = parse_args(argv)
    services = Services.start(config)
    if services.runlog.startup_error:
        logging.warning("serving without a run log for now: %s", services.runlog.startup_error)
    launch(build_app(services), config)
