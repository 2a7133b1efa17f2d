"""Diagnosis probes: where a benchmark's cost goes (rows read, per-projection calls, one call against two, worker
threads, one block's fused shrink). Not product figures; run one as ``.venv/bin/python -m scripts.probes.reads``."""
