"""Run reports: a run directory's `metrics.jsonl` rendered to figures and one HTML page (`sao report`)."""
