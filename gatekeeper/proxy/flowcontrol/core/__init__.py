"""Flow control's pure core: no asyncio, no I/O, time passed in (tests/architecture/test_layers.py)."""
