"""API Priority and Fairness in the proxy, one hop before the apiservers (docs/flowcontrol/).

The *core* (objects, policy, seats, listcost, borrowing, queueset, controller, coalesce, fleet) is
pure: no asyncio, sockets or files, time passed in (tests/architecture/test_layers.py enforces it). The *edge*
adapts it to the asyncio pipeline, policy files, Prometheus and worker processes (``ledger.py``: seats are
proxy-wide, queues stay per worker). Without the fleet, limits are per proxy: N replicas admit N times the seats.
"""
