"""``journeyman ui``: a read-only web viewer over a run store, to keep open beside a training run.

Runs, a run's curves (live), a step's groups with their attempts side by side, one attempt's
conversation and the tokens training learned from, and failures by stage. ``app.Viewer`` is the
ASGI app; ``runs`` and ``attempts`` read the store into what the pages show; the templates and the
vendored chart library (uPlot, MIT) ship inside the package, so nothing is fetched at run time.
"""
