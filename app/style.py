"""The page's theme and CSS: large readable type (it may be projected), the chosen methods side by side in one row
(compact panes that scroll sideways past four; on a phone one pane per screen, swiped, with the message box right
below), coloured messages that stay readable in dark mode, and Plotly figures recoloured for it."""
import gradio as gr

THEME = gr.themes.Soft(primary_hue="orange", secondary_hue="blue", neutral_hue="slate")

PANE_ORDERS = "\n".join(f".kitty-order-{i} {{ order: {i}; }}" for i in range(12))

CSS = """
.kitty-title h1 { margin: 0; font-size: 1.9rem; }
.kitty-title p { margin: 2px 0 0 0; color: var(--body-text-color-subdued); font-size: 1.02rem; }

/* One row of panes: compact panes share the width; past about four they scroll sideways, never wrap (the column
   holding them may shrink below its content's width, so the row scrolls instead of the page) */
.kitty-main { min-width: 0 !important; }
.kitty-panes { flex-wrap: nowrap !important; overflow-x: auto; gap: 10px; scroll-snap-type: x proximity;
               padding-bottom: 4px; }
.kitty-pane { flex: 1 1 0 !important; min-width: 220px !important; scroll-snap-align: start;
              border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 6px !important; }
""" + PANE_ORDERS + """
.kitty-pane-head { border-left: 6px solid; padding: 2px 8px; font-size: 1.05rem; min-height: 3.4em; }
.kitty-blind-head { border-color: var(--border-color-primary); }
.kitty-blind-head .kitty-dot { background: var(--body-text-color-subdued); }
.kitty-icon { font-weight: 700; margin-right: 4px; }
.kitty-dot { display: inline-block; width: 12px; height: 12px; border-radius: 50%; margin-right: 8px; }
.kitty-config { font-size: 0.8rem; color: var(--body-text-color-subdued); font-weight: normal; }
.kitty-metrics { font-size: 0.9rem; padding: 4px 2px; }
.kitty-metrics .kitty-idle, .kitty-metrics.kitty-idle { color: var(--body-text-color-subdued); font-size: 0.88rem; }
.kitty-metric { display: flex; justify-content: space-between; gap: 8px; padding: 2px 0;
                border-bottom: 1px dashed var(--border-color-primary); }
.kitty-metric b { font-variant-numeric: tabular-nums; text-align: right; }
.kitty-state { font-size: 0.85rem; color: var(--body-text-color-subdued); margin-bottom: 2px; }
.kitty-state-running { color: #b35c00; }
.kitty-state-error, .kitty-pane-error { color: #b3261e; }
.kitty-pane-error { font-weight: 600; margin: 4px 0; }
mark.kitty-diverge { background: #ffd43b; color: #1b1b1b; border-radius: 3px; padding: 0 2px;
                     outline: 2px solid #f08c00; }
.kitty-document summary { cursor: pointer; font-weight: 600; }
.kitty-document-text { white-space: pre-wrap; max-height: 200px; overflow: auto; font-size: 0.85rem; }

/* Messages: a background of their own and a text colour that wins over the theme's, in both themes */
.kitty-status { padding: 10px 14px; border-radius: 8px; font-size: 1.02rem; margin: 4px 0; }
.kitty-status .kitty-message, .kitty-status .kitty-icon { color: inherit !important; }
.kitty-error { background: #fdecea; color: #8a1c13 !important; border: 1px solid #f5c2bd; }
.kitty-warning { background: #fff4e5; color: #7a4b00 !important; border: 1px solid #ffd8a8; }
.kitty-stopped { background: #f1f3f5; color: #343a40 !important; border: 1px solid #ced4da; }
.kitty-ok { background: #eaf7ee; color: #1e5e2f !important; border: 1px solid #bfe5c9; }
.kitty-info, .kitty-running { background: #eef4fb; color: #1d4e89 !important; border: 1px solid #c9dcf2; }
.dark .kitty-error { background: #3b1512; color: #ffc9c3 !important; border-color: #7a2a22; }
.dark .kitty-warning { background: #3a2a08; color: #ffe08a !important; border-color: #7a5a10; }
.dark .kitty-stopped { background: #25282c; color: #dee2e6 !important; border-color: #495057; }
.dark .kitty-ok { background: #12301c; color: #b8f2c9 !important; border-color: #2b6a3e; }
.dark .kitty-info, .dark .kitty-running { background: #132a45; color: #c5dcff !important; border-color: #2d5488; }
.dark .kitty-state-running { color: #ffb35c; }
.dark .kitty-state-error, .dark .kitty-pane-error { color: #ff8a80; }
.kitty-permalink { margin-left: 10px; font-weight: 600; color: inherit !important; }
.kitty-footnote { font-size: 0.85rem; color: var(--body-text-color-subdued); }
.kitty-plot-intro { margin-top: 18px; }
.kitty-vote { border: 1px solid var(--border-color-primary); border-radius: 10px; padding: 6px 10px !important; }

/* Plotly figures have transparent backgrounds; in dark mode their text and grid lines turn light */
.dark .js-plotly-plot .main-svg text:not(.hoverlayer text) { fill: #e5e7eb !important; }
.dark .js-plotly-plot .gridlayer path, .dark .js-plotly-plot .zerolinelayer path { stroke: #3d434c !important; }
.dark .js-plotly-plot .modebar-btn path { fill: #9aa1ab !important; }

.kitty-progress { height: 16px; background: #e9ecef; border-radius: 8px; overflow: hidden; }
.kitty-bar { height: 100%; background: #F58518; transition: width 0.3s; }
.kitty-progress-text { margin-top: 4px; font-size: 0.98rem; }
.kitty-run-head h3 { margin: 6px 0; }
.kitty-prompt { margin-top: 6px; white-space: pre-wrap; max-height: 160px; overflow: auto; }
.kitty-cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(240px, 1fr)); gap: 12px; margin: 8px 0; }
.kitty-card { border: 1px solid var(--border-color-primary); border-top: 6px solid; border-radius: 8px; padding: 10px; }
.kitty-card-title { font-weight: 700; font-size: 1.1rem; margin-bottom: 6px; }
.kitty-answer { white-space: pre-wrap; max-height: 320px; overflow: auto; font-size: 1rem; }
.kitty-guide { color: var(--body-text-color-subdued); font-size: 1.02rem; padding: 18px 4px; }

/* Tables fit their column: headers wrap instead of pushing the last columns out of sight */
.kitty-fit table, #tab-teaching table { table-layout: auto; width: 100%; }
.kitty-fit th, .kitty-fit th *, #tab-teaching th, #tab-teaching th * { white-space: normal !important;
                                                                       overflow-wrap: break-word; }
.kitty-fit td, .kitty-fit td *, #tab-teaching td, #tab-teaching td * { overflow-wrap: break-word; }

/* A phone: the conversation first (panes one per screen, swiped sideways; the message box right below them),
   the settings after it */
@media (max-width: 700px) {
  .kitty-compare { flex-direction: column; }
  .kitty-compare > .column { align-self: stretch; width: 100%; }
  .kitty-compare > .kitty-controls { order: 2; }
  .kitty-pane { min-width: 82vw !important; }
  .kitty-ask { flex-direction: column; }
  .kitty-ask > * { width: 100%; }
  .kitty-pane-head { min-height: 0; }
}
"""
