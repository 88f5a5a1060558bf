"""Between the adapters and a backend: identity, RequestInfo, flow control, balancer (wired in stages.py)."""
