"""Benchmarks of the DeltaS memory: cost, bounds, ingest, end-to-end latency, retention.

Each module runs as `python -m bench.<name> [options]` and writes `<name>.json` and `<name>.md`
into its output directory (default bench/results/). See bench/README.md.
"""
