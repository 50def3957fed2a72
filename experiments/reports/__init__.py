"""One module per section of ``experiments/RESULTS.md``: ``TITLE``, ``RESULTS_FILE``, ``COMMAND`` and
``render(saved) -> str`` (pure: the committed JSON in, Markdown out; see :mod:`experiments.results_md`).
:mod:`experiments.reports.figures` opens and saves the rows of panels they draw."""
