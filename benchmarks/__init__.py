"""The benchmarks (a package: run each as ``python -m benchmarks.bench_NAME`` from the repository
root; see ``benchmarks/README.md``). ``_harness`` and ``_synthetic_plans`` are what they share."""
