"""Flow control's pure core: objects, policy, queues, seats, controller; no asyncio, no I/O,
time passed in (tests/architecture/test_layers.py enforces it).
"""
