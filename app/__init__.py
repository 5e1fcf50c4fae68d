"""Kitty Lab's web page: a thin Gradio layer over backend/ (generation, analysis) and storage/ (run history).

    from app.server import build_app, launch
    from app.services import Services
    from app.config import parse_args
    config = parse_args([])
    launch(build_app(Services.start(config)), config)

Modules: config (operator settings), services (models and run log shared by the handlers), runlog (runs in and
out of the database), compare_tab / history_tab / teaching_tab (one per tab), api (the JSON endpoint), plots
(Plotly figures), render (HTML snippets), style (theme and CSS), server (the page and its queue).
"""
