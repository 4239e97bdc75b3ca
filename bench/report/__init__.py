"""The Markdown report built from a run's JSON: tables, where the time goes, the targets; and its plots."""
