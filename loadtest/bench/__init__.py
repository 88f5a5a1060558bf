"""Benchmarks that answer a question about gatekeeper, one module each (``python -m loadtest.bench.<name>``)."""
