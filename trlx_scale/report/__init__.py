"""``trlx-scale report OUTPUT_DIR``: plots and a short markdown summary of a finished (or running) run.

- ``run_history``: reads ``trainer_state.json`` (the Trainer's log history) and ``run_summary.json``.
- ``render``: draws the PNGs with matplotlib (the optional ``report`` extra) and writes ``report.md``.
- ``command``: the CLI subcommand.
"""
