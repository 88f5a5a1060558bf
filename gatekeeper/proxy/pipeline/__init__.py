"""What happens to a request between the adapters and a backend, in order: identity (auth,
tokens/), RequestInfo, the flow-control hook, the balancer (stages.py wires them).
"""
