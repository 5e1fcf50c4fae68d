"""The benchmark command in its --quick mode (tiny shapes on a CPU): it runs, and its JSON holds real rows."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The system browsers backend/bench.py hands kaleido; with one installed, a PNG must come out.
BROWSERS = [p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
            if os.access(p, os.X_OK)]
# The bench must find the browser itself: a BROWSER_PATH from the caller's shell is dropped.
ENV = {k: v for k, v in os.environ.items() if k != "BROWSER_PATH"}


def assert_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, (path, len(data))


@pytest.mark.parametrize("kind,methods", [("attention", {"sdpa-fp16", "kitty", "kitty-pro", "kivi-k2v2", "fp16"}),
                                          ("generate", {"kitty-pro", "kitty", "hf-dynamic", "hf-static"})])
def test_bench_quick_writes_results(tmp_path, kind, methods):
    out = tmp_path / f"{kind}.json"
    done = subprocess.run([sys.executable, "-m", "backend.bench", kind, "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["kind"] == kind and result["env"]["torch"]
    rows = {row["method"]: row for row in result["rows"] if "error" not in row}
    assert methods <= set(rows), sorted(rows)
    for name in methods:
        row = rows[name]
        if kind == "attention":
            assert row["us"] > 0 and row["vs_sdpa"] > 0
            # the product's own kernel choice by default, and the kernel it took (no Gluon without a GPU)
            assert name == "sdpa-fp16" or (row["kernel"] == "auto" and row["ran"] == "triton")
        else:
            assert row["tokens_per_s"] > 0 and row["p50_ms"] > 0 and row["batch"] >= 1
            assert row["planned_batch"] == row["batch"] and row["oom_retries"] == 0     # no budget on a CPU
    assert out.with_suffix(".html").exists()                 # the Plotly figure of the table
    if BROWSERS:                                             # ... and its PNG, rendered by kaleido in that browser
        assert_png(out.with_suffix(".png"))
    else:
        assert "PNG skipped" in done.stderr and not out.with_suffix(".png").exists()


def test_bench_turn_times_a_ragged_next_turn(tmp_path):
    """`bench turn --quick`: a first turn of a different length per sequence, then the next turn for all of them,
    timed per method; the Kitty rows went through the chunk path on the ragged cache."""
    from backend import bench
    out = tmp_path / "turn.json"
    assert bench.main(["turn", "--quick", "--methods", "hf-dynamic", "kitty-pro", "--batch", "3", "--repeat", "1",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kind"] == "turn" and [r["method"] for r in result["rows"]] == ["hf-dynamic", "kitty-pro"]
    for row in result["rows"]:
        assert row["ms"] > 0 and row["tokens_per_s"] > 0 and row["turn"] == 12
        assert row["distinct_lengths"] == 3 and row["first_turn_lengths"] == [200, 300]
    assert out.with_suffix(".html").exists()


def test_plot_writes_png_from_results_json(tmp_path):
    """`bench plot` on results JSON measured elsewhere (a GPU machine with no browser) draws the PNG here."""
    if not BROWSERS:
        pytest.skip("no Chrome/Chromium at /usr/bin/chromium, /usr/bin/chromium-browser or /usr/bin/google-chrome")
    rows = [{"method": m, "batch": b, "tokens": 32768, "us": us * b, "vs_sdpa": 1.0}
            for m, us in (("sdpa-fp16", 40.0), ("kitty-pro", 95.0), ("quanto-2", 900.0)) for b in (1, 8, 64)]
    rows.append({"method": "kivi-k2v2", "batch": 64, "tokens": 32768, "error": "out of memory"})
    results = tmp_path / "attention.json"
    results.write_text(json.dumps({"kind": "attention", "rows": rows, "env": {"torch": "2.13.0"}}))
    done = subprocess.run([sys.executable, "-m", "backend.bench", "plot", str(results)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    png = results.with_suffix(".png")
    assert str(png) in done.stdout.splitlines(), done.stdout + done.stderr[-2000:]
    assert_png(png)
    assert results.with_suffix(".html").exists()


def test_tune_figure_gives_every_setting_its_own_bars(tmp_path):
    """`bench plot` of a tune sweep: settings that differ only in a field beyond warps, stages, cap and kernel (the
    half of a launch, PDL) are series of their own, whose bars stand side by side instead of stacking into one."""
    from backend.bench import TUNE_DEFAULTS, write_figures
    settings = ((None, None, 480.0), ("arithmetic", ["alu", 64], 320.0))      # a pad as saved JSON holds it: a list
    rows = [dict(TUNE_DEFAULTS, method=m, batch=64, tokens=32768, splits=3, us=us, kernel="gluon-tma", loads=loads,
                 pad=pad) for m in ("kitty-pro", "kivi-k2v2") for loads, pad, us in settings]
    html, *_ = write_figures({"kind": "tune", "rows": rows}, tmp_path / "tune.json")
    text = html.read_text()
    start = re.search(r'Plotly\.newPlot\(\s*"[^"]+",\s*', text).end()
    traces, _ = json.JSONDecoder().raw_decode(text, start)                   # the figure's data: its bar series
    assert len(traces) == 2 and {t["name"] for t in traces} == {"warps 1, stages 3, maxnreg 128, kernel gluon-tma",
                                                                "warps 1, stages 3, maxnreg 128, kernel gluon-tma, "
                                                                "loads arithmetic, pad ('alu', 64)"}
    assert all(t["x"] == ["kitty-pro B=64 L=32768 splits=3", "kivi-k2v2 B=64 L=32768 splits=3"] for t in traces)


def test_bench_quality_puts_each_kernels_arithmetic_beside_the_caches(tmp_path):
    """`bench quality`: teacher-forced KL from full precision on the default model per method and decode kernel; the
    8-bit keys' arithmetic (i8_reference on a CPU) fed one token a step, within a few percent of the exact kernel's
    KL, which the 2-bit cache itself makes far from zero."""
    out = tmp_path / "quality.json"
    done = subprocess.run([sys.executable, "-m", "backend.bench", "quality", "--prompt", "176", "--methods",
                           "kivi-k2v2", "--kernels", "auto", "gluon-tma-i8k", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["kind"] == "quality" and result["tokens"] == 160 and out.with_suffix(".html").exists()
    full, exact, i8k = result["rows"]
    assert full["kl"] == 0 and (exact["kernel"], i8k["kernel"]) == ("auto", "gluon-tma-i8k")
    assert (exact["fed"], i8k["fed"]) == ("page chunks", "one token a step")
    assert exact["kl"] > 0.01 and abs(i8k["kl"] - exact["kl"]) < 0.05 * exact["kl"], result["rows"]
    assert full["perplexity"] < exact["perplexity"]


def test_bench_compare_times_the_pages_comparison(tmp_path):
    """`bench compare`: the page's comparison on the default model, timed until answered and until scored."""
    out = tmp_path / "compare.json"
    done = subprocess.run([sys.executable, "-m", "backend.bench", "compare", "--new-tokens", "4", "--repeat", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["kind"] == "compare" and set(row["tokens"]) == {"fp16", "kivi-k2v2", "kitty"}
    assert set(row["tokens"].values()) == {4} and all(v > 0 for v in row["tokens_per_s"].values())
    assert 0 < row["answers_s"] <= row["with_scoring_s"] and out.with_suffix(".html").exists()


def test_bench_generate_with_chunked_prefill(tmp_path):
    """`generate --prefill-chunk 16`: every method's prompt goes through its cache 16 tokens at a time (a prompt of
    200 gives kitty-pro a page per layer before its last chunks, which then read it dequantized)."""
    out = tmp_path / "generate.json"
    done = subprocess.run([sys.executable, "-m", "backend.bench", "generate", "--quick", "--prefill-chunk", "16",
                           "--prompt", "200", "--methods", "hf-dynamic", "kitty-pro", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["prefill_chunk"] == 16
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"hf-dynamic", "kitty-pro"}
    for row in rows.values():
        assert "error" not in row and row["prefill_chunk"] == 16 and row["prompt"] == 200
        assert row["tokens_per_s"] > 0 and row["ttft_ms"] > 0


def test_generate_warms_up_with_the_runs_page_settings(tmp_path, monkeypatch):
    """The untimed warm-up generation makes pages the way the timed one will (flush mode, flush_spread, prefill
    chunk): the fused page kernels take flush_spread as a compile-time constant, so a warm-up without it left their
    compilation inside the timed run."""
    from backend import bench
    calls, real = [], bench.run_generate

    def recorded(model, method, batch, prompt, new_tokens, flush_spread=1, prefill_chunk=None, cuda_graphs=False,
                 flush="torch", decode_kernel="auto"):
        calls.append((batch, flush_spread, prefill_chunk, flush))
        return real(model, method, batch, prompt, new_tokens, flush_spread, prefill_chunk, cuda_graphs, flush,
                    decode_kernel=decode_kernel)

    monkeypatch.setattr(bench, "run_generate", recorded)
    assert bench.main(["generate", "--quick", "--methods", "kitty-pro", "--batch", "3", "--flush-spread", "3",
                       "--flush", "fused", "--prefill-chunk", "16", "--prompt", "40", "--new-tokens", "4",
                       "--out", str(tmp_path / "generate.json")]) == 0
    assert calls == [(1, 3, 16, "fused"), (3, 3, 16, "fused")]


def test_generate_with_flush_spread_auto_takes_the_batchs_spread(tmp_path, monkeypatch):
    """`--flush-spread auto`: the warm-up and the timed run take auto_flush_spread of the batch (30 sequences: 2
    steps of at most 24), and the row says so."""
    from backend import bench
    calls, real = [], bench.run_generate

    def recorded(model, method, batch, prompt, new_tokens, flush_spread=1, *rest, **kwargs):
        calls.append((batch, flush_spread))
        return real(model, method, batch, prompt, new_tokens, flush_spread, *rest, **kwargs)

    monkeypatch.setattr(bench, "run_generate", recorded)
    out = tmp_path / "generate.json"
    assert bench.main(["generate", "--quick", "--methods", "kitty-pro", "--batch", "30", "--flush-spread", "auto",
                       "--prompt", "40", "--new-tokens", "4", "--out", str(out)]) == 0
    assert calls == [(1, 2), (30, 2)]
    row = json.loads(out.read_text())["rows"][0]
    assert row["flush_spread"] == 2
    # the slowest step after an eager one and (on a GPU) a CUDA graph's capture: 3 decode steps after the first token
    assert 0 < row["max_steady_ms"] <= row["max_ms"]


def test_sampled_generation_integrates_the_measured_step_times(monkeypatch):
    """`generate --sample-contexts N`: runs of a few steps at N contexts from the prompt to the last token, each with
    the batch and a cache made for the whole generation; the decode time is the median step times integrated over
    the contexts (exact for step times linear in the context, as a growing cache's are, but for the 8 steps past
    the first and last runs' middles). A later context's run has the tokens before its prompt cached first."""
    import argparse

    from backend import bench
    calls = []

    def timed(model, method, batch, prompt, new_tokens, flush_spread=1, prefill_chunk=None, cuda_graphs=False,
              flush="auto", cache_tokens=None, cached=0, decode_kernel="auto"):
        calls.append((batch, prompt, new_tokens, cache_tokens, cached))
        context = cached + prompt                                                     # steps at context .. + 15
        return dict(p50_ms=2.0 + 0.01 * (context + 7.5), ttft_ms=500.0, prefill_peak_gb=None, decode_peak_gb=None)

    monkeypatch.setattr(bench, "run_generate", timed)
    args = argparse.Namespace(sample_contexts=5, sample_steps=16, prefill_chunk=None, flush="auto")
    row = bench.sampled_generate(None, "hf-dynamic", 8, 512, 8192, args, graphed=False)
    assert calls == [(8, 512, 16, 512 + 8192, c - 512) for c in (512, 2556, 4600, 6644, 8688)]
    decode_s = sum(2.0 + 0.01 * c for c in range(512, 512 + 8191)) / 1e3
    assert row["estimated"] and row["decode_tokens_per_s"] == pytest.approx(8 * 8191 / decode_s, rel=1e-5)
    assert row["tokens_per_s"] == pytest.approx(8 * 8192 / (0.5 + decode_s), rel=1e-5)
    assert [x["context"] for x in row["samples"]] == [512, 2556, 4600, 6644, 8688]


def test_bench_generate_runs_each_kitty_method_with_each_decode_kernel(tmp_path, monkeypatch):
    """`generate --kernels auto gluon-tma-i8`: transformers' caches once, each Kitty method once per decode kernel,
    its cache made with that kernel (on a CPU the 8-bit kernels' arithmetic, kernels/i8_reference.py), the row
    naming it."""
    import backend
    from backend import bench
    made = []

    def recording(model, method, **options):
        made.append((method, options["decode_kernel"]))
        return real(model, method, **options)

    real = backend.make_cache
    monkeypatch.setattr(backend, "make_cache", recording)
    out = tmp_path / "generate.json"
    assert bench.main(["generate", "--quick", "--methods", "hf-dynamic", "kitty-pro", "--kernels", "auto",
                       "gluon-tma-i8", "--batch", "2", "--prompt", "40", "--new-tokens", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["decode_kernel"]) for r in rows] == [("hf-dynamic", "auto"), ("kitty-pro", "auto"),
                                                                  ("kitty-pro", "gluon-tma-i8")]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    # a warm-up and the timed run each
    assert made == [("kitty-pro", "auto")] * 2 + [("kitty-pro", "gluon-tma-i8")] * 2


def test_bench_generate_sampled_runs_every_method(tmp_path):
    """The sampled mode end to end on tiny shapes: transformers' caches and a Kitty cache give estimated rows."""
    out = tmp_path / "generate.json"
    done = subprocess.run([sys.executable, "-m", "backend.bench", "generate", "--quick", "--new-tokens", "12",
                           "--sample-contexts", "2", "--sample-steps", "3", "--methods", "hf-static", "kitty-pro",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
    for row in rows.values():
        assert row["estimated"] and [x["context"] for x in row["samples"]] == [40, 49]
        assert row["decode_tokens_per_s"] > 0 and row["tokens_per_s"] > 0


@pytest.mark.parametrize("method,flush_spread", [("kitty-pro", 1), ("kivi-k2v2", 2)])
def test_generate_plans_with_what_the_cache_and_the_decode_workspace_allocate(method, flush_spread):
    """The batch plan's bytes per sequence are those a reserved Kitty cache allocates after a generation (its
    bytes_reserved: buffers at capacity, every page up front), and its decode-workspace term covers what the
    decode kernel's workspace takes, per layer. (The 512 + 8,192 plan counted only the stored tokens and ran out
    of memory on the H200: BENCHMARKS.md section 2.)"""
    from backend.bench import build_model, decode_workspace_bytes, kv_bytes_per_sequence, make_peer_cache
    from kernels.decode_attention import DecodeWorkspace, decode_attention
    model = build_model(quick=True)
    batch, prompt, new = 3, 150, 12
    cache = make_peer_cache(method, model, batch, prompt + new, flush_spread)
    ids = torch.randint(3, 500, (batch, prompt), generator=torch.Generator().manual_seed(2))
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                   min_new_tokens=new, do_sample=False, disable_compile=True)
    assert cache.stats().bytes_reserved == batch * kv_bytes_per_sequence(method, model, prompt + new, flush_spread)
    cfg = model.config
    workspace = DecodeWorkspace()
    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim)
    decode_attention(q, cache.layers[0].paged(), cfg.head_dim ** -0.5, workspace=workspace)
    used = cfg.num_hidden_layers * sum(t.numel() * t.element_size() for t in workspace.buffers)
    fixed, per_sequence = decode_workspace_bytes(method, model, flush_spread, sm_count=4)   # a CPU counts as 4
    assert 0 < used <= fixed + batch * per_sequence


def test_static_cache_plan_counts_the_keys_transformers_repeats(monkeypatch):
    """Where transformers copies a layer's static keys and values to all query heads (repeat_kv: 5.17, the H200's),
    the plan's transient per sequence covers the largest such pair (a cache made for 5x the prompt, so that the
    copy outgrows the prompt's activations); where it reads them in place (5.23), hf-static plans as hf-dynamic.
    (Without it the 512 + 8,192 plan on the H200 was 46 sequences and ran out of memory; 41 ran: BENCHMARKS.md
    section 2, session 13.)"""
    from transformers.integrations import sdpa_attention

    from backend.bench import build_model, make_peer_cache, prefill_bytes_per_sequence
    model = build_model(quick=True)
    batch, prompt, new, cache_tokens = 2, 40, 4, 200
    sizes, repeat = [], sdpa_attention.repeat_kv

    def recording(x, n_rep):
        out = repeat(x, n_rep)
        sizes.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(sdpa_attention, "repeat_kv", recording)
    ids = torch.randint(3, 500, (batch, prompt), generator=torch.Generator().manual_seed(2))
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=make_peer_cache(
        "hf-static", model, batch, cache_tokens), max_new_tokens=new, min_new_tokens=new, do_sample=False,
        disable_compile=True)
    static = prefill_bytes_per_sequence("hf-static", model, prompt, None, cache_tokens)
    dynamic = prefill_bytes_per_sequence("hf-dynamic", model, prompt, None, cache_tokens)
    if sizes:
        assert static >= 2 * max(sizes) / batch > dynamic
    else:
        assert static == dynamic


def test_step_profile_quick_splits_ordinary_and_page_boundary_steps(tmp_path):
    """`python -m backend.step_profile --quick` on the CPU: every decode step is timed and classed, a page-boundary
    step is profiled (its host operations listed), and transformers' caches have no page-boundary steps."""
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "backend.step_profile", "--quick", "--prompt", "150", "--batch", "2",
                           "--steps", "30", "--methods", "hf-dynamic", "kitty-pro", "--cuda-graphs", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["hf-dynamic", "kitty-pro", "kitty-pro"]      # kitty-pro eager and graphed
    hf, kitty, graphed = rows
    assert "page_boundary" not in hf and hf["ordinary"]["count"] == 30
    # 150 + i + 1 - 32 sink tokens fill a 128-token key buffer at step i = 9 (and the profile finds the next one)
    assert kitty["ordinary"]["count"] == 29 and kitty["page_boundary"]["count"] == 1
    for row in rows:
        assert row["ordinary"]["step_ms"] > 0 and row["ordinary"]["issue_ms"] > 0
    assert kitty["page_boundary"]["top_host_ops"] and kitty["page_boundary"]["top_host_ops"][0]["self_cpu_ms"] > 0
    # on a CPU nothing is replayed: the cache's steps run eagerly, and the row says so
    assert graphed["cuda_graphs"] == {"captures": 0, "replays": 0, "disabled": None}


def test_step_profile_bookkeeping_times_the_hosts_share_of_replayed_steps(tmp_path):
    """`python -m backend.step_profile --bookkeeping`: the cache's host work in replayed decode steps, page-making
    kernels left out, split into ordinary and page-boundary steps (a 150-token prompt: boundaries every 128 steps
    from step 9 on), written to --out."""
    out = tmp_path / "bookkeeping.json"
    done = subprocess.run([sys.executable, "-m", "backend.step_profile", "--bookkeeping", "--prompt", "150",
                           "--batch", "3", "--steps", "300", "--methods", "kitty-pro", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-2000:]
    row, = json.loads(out.read_text())["rows"]
    assert row["boundary_steps"] == 3 and row["layers"] == 36
    assert row["boundary_ms"] > row["ordinary_ms"] > 0


def test_results_name_the_measured_sources_by_git_blob_id(tmp_path):
    """Every result's env carries the git blob ids of the files that decide its figures (the device machine has
    no git history of the session): each equals `git hash-object` of the file, and changes with its contents."""
    from backend.bench import MEASURED_SOURCES, environment, git_blob_id
    sources = environment()["sources"]
    assert sorted(sources) == sorted(MEASURED_SOURCES)
    copy = tmp_path / "kernel.py"
    copy.write_bytes((ROOT / MEASURED_SOURCES[0]).read_bytes() + b"\n")
    assert git_blob_id(copy) != sources[MEASURED_SOURCES[0]]
    if shutil.which("git") is None:
        pytest.skip("no git here to compare with")
    for name, blob in sources.items():
        hashed = subprocess.run(["git", "hash-object", str(ROOT / name)], capture_output=True, text=True, check=True)
        assert blob == hashed.stdout.strip(), name


def test_gpu_report_passes_each_steps_own_arguments(tmp_path):
    """The one command a device call runs: each generate table, the attention table, the tune sweep and the energy
    rows get the arguments given for them."""
    from backend.gpu_report import main, step_commands
    parser_args = type("Args", (), dict(pytest="tests/test_kernels.py -k gluon", tune="--vary warps --batches 1",
                                        generate=["--prompt 64 --methods kitty", "--prompt 32"], baseline="old",
                                        turn="--batch 4", attention="--kernels triton gluon", energy="--batch 8",
                                        baseline_attention="--kernels gluon --methods kitty-pro",
                                        profile=["", "--methods kivi-k2v2 --batches 8",
                                                 "--command tune --nvtx-range gluon-tma.arithmetic.168 -- --vary "
                                                 "loads"]))
    steps = step_commands(parser_args, tmp_path)
    assert steps["baseline"][0] == ([sys.executable, "-m", "backend.bench", "attention", "--kernels", "gluon",
                                     "--methods", "kitty-pro", "--out", str(tmp_path / "baseline.json")], "old")
    assert steps["tune"][0][0][-6:] == ["--vary", "warps", "--batches", "1", "--out", str(tmp_path / "tune.json")]
    assert steps["attention"][0][0][-6:] == ["attention", "--kernels", "triton", "gluon", "--out",
                                              str(tmp_path / "attention.json")]
    assert steps["turn"][0][0][-5:] == ["turn", "--batch", "4", "--out", str(tmp_path / "turn.json")]
    assert steps["energy"][0][0][2:] == ["backend.energy", "--batch", "8", "--out", str(tmp_path / "energy.json")]
    generate = [cmd[-5:-2] for cmd, _ in steps["generate"]]
    assert generate == [["64", "--methods", "kitty"], ["generate", "--prompt", "32"]]
    assert steps["tests"][0][0][-3:] == ["tests/test_kernels.py", "-k", "gluon"]
    assert steps["profile"][0][0][2:] == ["backend.kernel_profile", "--out", str(tmp_path), "--name", "profile0", "--"]
    assert steps["profile"][1][0][6:] == ["profile1", "--", "--methods", "kivi-k2v2", "--batches", "8"]
    assert steps["profile"][2][0][6:] == ["profile2", "--command", "tune", "--nvtx-range", "gluon-tma.arithmetic.168",
                                          "--", "--vary", "loads"]
    # a real run of one cheap step: its status line and log, a row for each method it names
    tune = "--quick --vary --methods kivi-k2v2 kitty"
    assert main(["--out", str(tmp_path / "run"), "--steps", "tune", "--tune", tune]) == 0
    assert "===== tune: exit 0" in (tmp_path / "run" / "log.txt").read_text()
    tuned = json.loads((tmp_path / "run" / "tune.json").read_text())
    assert tuned["kind"] == "tune" and [row["method"] for row in tuned["rows"]] == ["kivi-k2v2", "kitty"]


def test_kernel_profile_sums_the_source_pages_columns_by_opcode(tmp_path):
    """backend.kernel_profile's summary of ncu's source page (no GPU here: a CSV of its shape, the instruction text
    in "Source", numbers with thousands separators, a predicate before an opcode): every numeric column summed per
    opcode, the opcodes and instructions ranked by the stall-sample column; the commands profile one launch of the
    kernel asked for inside `bench attention` and export its details and source page."""
    from backend.kernel_profile import ncu_commands, summarize_source
    text = ("\"Address\",\"Source\",\"Warp Stall Sampling (All Samples)\",\"Instructions Executed\"\n"
            "\"0x10\",\"LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT ;\",\"1,200\",\"64\"\n"
            "\"0x20\",\"@!P0 LDG.E.U16 R4, desc[UR4][R6.64] ;\",\"3,000\",\"8\"\n"
            "\"0x30\",\"LOP3.LUT R5, R2, 0xc, RZ, 0xc0, !PT ;\",\"900\",\"64\"\n"
            "\"0x40\",\"HMMA.16816.F32 R8, R12, R16, R8 ;\",\"500\",\"16\"\n")
    summary = summarize_source(text, top=2)
    assert summary["ranked_by"] == "Warp Stall Sampling (All Samples)"
    assert [row["opcode"] for row in summary["opcodes"]] == ["LDG", "LOP3", "HMMA"]
    lop3 = summary["opcodes"][1]
    assert lop3["instructions"] == 2 and lop3["Warp Stall Sampling (All Samples)"] == 2100
    assert lop3["Instructions Executed"] == 128
    assert [row["Address"] for row in summary["instructions"]] == ["0x20", "0x10"]
    with pytest.raises(ValueError, match="source page"):
        summarize_source("a,b\n1,2\n")
    profile, details, source = ncu_commands(tmp_path, "_gluon_paged_kernel", ["--batches", "64"])
    assert profile[0] == "ncu" and "regex:_gluon_paged_kernel" in profile and "SourceCounters" in profile
    assert profile[-5:] == ["attention", "--batches", "64", "--out", str(tmp_path / "bench.json")]
    assert details[-2:] == ["--page", "details"] and source[-4:] == ["source", "--csv", "--print-source", "sass"]
    # bench tune's launches, one setting's: its NVTX range (bench.tune_range) selects the launch
    from backend.bench import tune_range
    name = tune_range(dict(kernel="gluon-tma", loads="arithmetic", maxnreg=168))
    assert name == "gluon-tma.arithmetic.168"
    profile = ncu_commands(tmp_path, "_gluon_paged_kernel", ["--vary", "loads"], "tune", name)[0]
    assert profile[profile.index("--nvtx-include") + 1] == name + "/" and "--nvtx" in profile
    assert profile[-5:] == ["tune", "--vary", "loads", "--out", str(tmp_path / "bench.json")]


def test_timeline_says_how_many_programs_a_multiprocessor_ran_at_once():
    """bench tune --vary timeline's summary of a launch's (start ns, end ns, multiprocessor) rows: two
    multiprocessors, two programs each, over a 2 us span."""
    from backend.bench import timeline
    rows = torch.tensor([[0, 1000, 0], [500, 1500, 0], [0, 2000, 1], [100, 900, 1]])
    summary = timeline(rows)
    assert summary["span_us"] == 2.0 and summary["starts_us"] == 0.5 and summary["ends_us"] == 1.1
    assert (summary["shortest_us"], summary["median_us"], summary["longest_us"]) == (0.8, 1.0, 2.0)
    assert summary["fewest_a_sm"] == summary["most_a_sm"] == 2
    assert summary["at_once_a_sm"] == 4.8 / 2.0 / 2 and "key_wait_pct" not in summary
    # rows with the page loop's waits (decode_gluon's WAITS): key and value waits, cycles, two unused columns
    waits = torch.tensor([[10, 30, 100, 0, 0], [20, 0, 50, 0, 0], [0, 30, 200, 0, 0], [10, 0, 50, 0, 0]])
    summary = timeline(torch.cat([rows, waits], dim=1))
    assert summary["key_wait_pct"] == 100 * 40 / 400 and summary["value_wait_pct"] == 100 * 60 / 400


def test_a_calls_timeline_gives_the_tail_the_remaining_blocks_add():
    """bench tune --vary timeline's whole call (call_timeline): in µs from the paged launch's first start, its span
    and the spread of its ends; the remaining blocks' programs' first start, the share that started before the
    paged launch's last end, their median and longest times and how far the last ends past the paged launch; rows
    never written (zero) are not programs."""
    from backend.bench import call_timeline
    paged = torch.tensor([[1000, 5000, 0], [1000, 6000, 1], [2000, 7000, 2], [0, 0, 0]])
    rest = torch.tensor([[1500, 2500, 3], [6500, 8000, 1], [7000, 9000, 2], [0, 0, 0], [0, 0, 0]])
    summary = call_timeline(paged, rest)
    assert summary == pytest.approx({"paged_span_us": 6.0, "paged_ends_us": 2.0, "rest_first_start_us": 0.5,
                                     "rest_started_before_paged_end_pct": 200 / 3, "rest_median_us": 1.5,
                                     "rest_longest_us": 2.0, "tail_us": 2.0})


def test_launches_in_a_row_give_their_spans_and_gaps():
    """bench tune --vary timeline's launches in a row (back_to_back): each launch's span and the gaps between
    launches, negative where one began before the last ended; nothing to run on a CPU."""
    from backend.bench import back_to_back, sequence
    first = torch.tensor([[0, 3000, 0], [1000, 4000, 1]])
    second = torch.tensor([[3500, 6000, 0], [3800, 6500, 1]])         # starts 0.5 us before the first ends
    third = torch.tensor([[7000, 9000, 0], [7000, 9500, 1]])
    summary = sequence([first, second, third])
    assert (summary["span_min_us"], summary["span_median_us"], summary["span_max_us"]) == (2.5, 3.0, 4.0)
    assert (summary["gap_min_us"], summary["gap_max_us"]) == (-0.5, 0.5)
    assert back_to_back(lambda times: None, 2, "cpu") == {}


def test_clock_samples_become_their_medians():
    """bench tune's clock, power and temperatures per setting (gpu_clocks): the medians of nvidia-smi's samples and
    their most frequent clock event reasons, each field from the samples that could read it (a line of another shape
    is skipped); nothing without a sample (on a CPU the rows have no clocks). A sample counts only between the
    launches' first and last (its timestamp)."""
    from datetime import datetime

    from backend.bench import _sampled_between, gpu_clocks, median_clocks
    samples = ("1980, 650.5, 0x0000000000000000, 41, 50\n1755, 699.9, 0x0000000000000004, 47, 55\n"
               "[N/A], [N/A], [N/A], [N/A], [N/A]\n1700, 700.1, 0x0000000000000004, 49, [N/A]\n1650, 700\n\n")
    assert median_clocks(samples) == {"sm_mhz": 1755.0, "power_w": 699.9, "clock_reasons": 4, "gpu_c": 47.0,
                                      "memory_c": 52.5}
    assert median_clocks("1980, 650.5, 0x0, [N/A], [N/A]\n") == {"sm_mhz": 1980.0, "power_w": 650.5,
                                                                  "clock_reasons": 0}
    assert median_clocks("[N/A], [N/A], [N/A], [N/A], [N/A]\n") == {}
    assert gpu_clocks(lambda: None, "cpu") == {}
    start, stop = datetime(2026, 12, 4, 20, 51, 3), datetime(2026, 12, 4, 20, 51, 5)
    assert _sampled_between("2026/12/04 20:51:04.250", start, stop)
    assert not _sampled_between("2026/12/04 20:51:02.990", start, stop) and not _sampled_between("[N/A]", start, stop)


def test_results_name_the_gpus_power_limits():
    """Each result's env names the GPU's power limits and memory bandwidth (machines of one kind run the
    power-capped launch at different speeds): nvidia-smi's line parsed, unreadable values left out; none on a
    CPU."""
    import torch

    from backend.bench import environment, parse_power_limits
    assert parse_power_limits("700.00, 620.00, 700.00\n") == {"power_limit_w": 700.0, "enforced_power_limit_w": 620.0,
                                                              "power_max_limit_w": 700.0}
    assert parse_power_limits("[N/A], 700.00, [N/A]") == {"enforced_power_limit_w": 700.0}
    assert parse_power_limits("") == {}
    env = environment()
    if torch.cuda.is_available():
        assert env["memory_gbs"] is None or env["memory_gbs"] > 0
        assert all(watts > 0 for name, watts in env.items() if name.endswith("limit_w"))
    else:
        assert env["memory_gbs"] is None and "power_limit_w" not in env


def test_local_spikes_compare_a_boundary_step_with_the_steps_around_it():
    """The page-boundary bar's measure: a boundary step over the median of the ordinary steps near it, so that a
    step time growing with the context is no spike, and the first two steps (eager, graph capture) count for
    nothing."""
    from backend.bench import local_spikes
    steps = np.linspace(10.0, 20.0, 400)                  # grows 2x over the run, as a long generation does
    steps[:2] = 500.0
    boundary = np.zeros(400, dtype=bool)
    boundary[[1, 100, 101, 300]] = True
    steps[100] *= 1.5
    steps[300] *= 1.1
    spikes = local_spikes(steps, boundary, neighbours=8)
    assert spikes == pytest.approx([1.5, 1.0, 1.1], rel=0.01)
    assert local_spikes(steps, np.zeros(400, dtype=bool)).size == 0


def test_energy_rows_above_idle():
    """backend.energy: a row's energy a call is its power above the idle GPU's times its time, and per byte that
    over the bytes it reads (the H100 readings of BENCHMARKS.md section 1, session 45, call 10: the paged launch's
    copies alone, 428.5 us at 512.3 W over 117.1 W idle for 1,335,853,056 bytes, 169.4 mJ and 126.8 pJ a byte); a row
    without a power reading (a CPU) is left as it is, and on a CPU the command says it needs a GPU."""
    from backend.energy import energy, main
    rows = energy({"idle": {"power_w": 117.1}, "copies": {"us": 428.5, "bytes": 1_335_853_056, "power_w": 512.3},
                   "cpu": {"us": 10.0, "bytes": 100}})
    assert rows["copies"]["mj"] == pytest.approx(169.3, abs=0.1)
    assert rows["copies"]["pj_per_byte"] == pytest.approx(126.8, abs=0.05)
    assert "mj" not in rows["cpu"] and "mj" not in rows["idle"]
    if not torch.cuda.is_available():
        assert main([]) == 2
