"""Flow control's edge: the asyncio middleware, fan-out, policy files and reloads, metrics,
and the sandbox default policy (seeds.yaml, package data).
"""
