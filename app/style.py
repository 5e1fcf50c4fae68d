"""The page's theme and CSS: large readable type (it may be projected), panes that wrap, coloured messages."""
import gradio as gr

THEME = gr.themes.Soft(primary_hue="orange", secondary_hue="blue", neutral_hue="slate")

CSS = """
.kitty-title h1 { margin: 0; font-size: 1.9rem; }
.kitty-title p { margin: 2px 0 0 0; color: var(--body-text-color-subdued); font-size: 1.02rem; }
.kitty-panes { flex-wrap: wrap; gap: 12px; }
.kitty-pane { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 8px; }
.kitty-pane-head { border-left: 6px solid; padding: 4px 10px; font-size: 1.15rem; min-height: 4em; }
.kitty-icon { font-weight: 700; margin-right: 4px; }
.kitty-dot { display: inline-block; width: 12px; height: 12px; border-radius: 50%; margin-right: 8px; }
.kitty-config { font-size: 0.85rem; color: var(--body-text-color-subdued); font-weight: normal; }
.kitty-metrics { font-size: 0.98rem; padding: 4px 2px; }
.kitty-metrics.kitty-idle { color: var(--body-text-color-subdued); font-size: 0.9rem; }
.kitty-metric { display: flex; justify-content: space-between; gap: 8px; padding: 3px 0;
                border-bottom: 1px dashed var(--border-color-primary); }
.kitty-metric b { font-variant-numeric: tabular-nums; }
.kitty-state { font-size: 0.88rem; color: var(--body-text-color-subdued); margin-bottom: 2px; }
.kitty-state-running { color: #b35c00; }
.kitty-state-error { color: #b3261e; }
.kitty-pane-error { color: #b3261e; font-weight: 600; margin: 4px 0; }
.kitty-status { padding: 10px 14px; border-radius: 8px; font-size: 1.02rem; margin: 4px 0; }
.kitty-error { background: #fdecea; color: #8a1c13; border: 1px solid #f5c2bd; }
.kitty-warning { background: #fff4e5; color: #7a4b00; border: 1px solid #ffd8a8; }
.kitty-ok { background: #eaf7ee; color: #1e5e2f; border: 1px solid #bfe5c9; }
.kitty-info, .kitty-running { background: #eef4fb; color: #1d4e89; border: 1px solid #c9dcf2; }
.kitty-permalink { margin-left: 10px; font-weight: 600; }
.kitty-footnote { font-size: 0.85rem; color: var(--body-text-color-subdued); }
.kitty-plot-intro { margin-top: 18px; }
.kitty-progress { height: 16px; background: #e9ecef; border-radius: 8px; overflow: hidden; }
.kitty-bar { height: 100%; background: #F58518; transition: width 0.3s; }
.kitty-progress-text { margin-top: 4px; font-size: 0.98rem; }
.kitty-run-head h3 { margin: 6px 0; }
.kitty-prompt { margin-top: 6px; white-space: pre-wrap; max-height: 160px; overflow: auto; }
.kitty-cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(280px, 1fr)); gap: 12px; margin: 8px 0; }
.kitty-card { border: 1px solid var(--border-color-primary); border-top: 6px solid; border-radius: 8px; padding: 10px; }
.kitty-card-title { font-weight: 700; font-size: 1.1rem; margin-bottom: 6px; }
.kitty-answer { white-space: pre-wrap; max-height: 320px; overflow: auto; font-size: 1rem; }
"""
