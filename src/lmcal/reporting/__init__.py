"""What runs wrote, read back and written up: results.json from the stages' records, REPORT.md with its setup
sentences and the claims generated from the numbers, the tables over run folders (runs.md, the memory and decoders
tables, the scale table and fit), the report's W&B run, and docs/RESULTS.md's snapshots. It reads files and numbers;
it plans and runs nothing (that is lmcal.pipeline)."""
