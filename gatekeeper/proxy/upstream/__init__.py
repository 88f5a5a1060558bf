"""The proxy's side towards the apiservers: multiplexed HTTP/2 for short reads, pooled HTTP/1.1 for the rest, upgrades.

:mod:`upstream.client` routes each request (its docstring says which path takes what).
"""
