"""Load scenarios that reproduce the seeds' incidents and write a report each (``python -m loadtest``).

The older one-shot benchmarks (``bench_*.py``, ``run_locust.py``) stay runnable as scripts.
"""
