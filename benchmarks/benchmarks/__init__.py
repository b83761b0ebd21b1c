"""asv benchmarks for lorahook (run from benchmarks/: ``asv run --quick``)."""
