"""`make reproduce`: the plan of stages, their scheduling as processes, the stage records, results.json, REPORT.md,
the tables over run folders, and docs/RESULTS.md."""
