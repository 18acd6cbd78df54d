"""What every layer shares: atomic writes, the run-folder lock, settings and their range rules, how numbers read,
and where time goes (profiling)."""
