"""One module per scenario: what it measures, on which cells, and the bench step that runs it."""
