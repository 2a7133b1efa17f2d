"""Set-up, demo, test and benchmark entry points, run from the repository root as modules
(``.venv/bin/python -m scripts.bench_kernels --quick``): the product benchmarks ``bench_*.py`` (what
``scripts/bench_all`` and ``scripts/gpu_figures`` run), the diagnosis probes in ``probes/`` and the one harness they
share in ``harness/``."""
