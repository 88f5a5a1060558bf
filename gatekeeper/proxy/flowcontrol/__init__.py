"""API Priority and Fairness in the proxy, one hop before the apiservers.

Layering, data flowing down:

* ``objects.py``   v1 FlowSchema / PriorityLevelConfiguration validation (errors name object and field)
* ``policy.py``    built-in objects, upstream matching rules, nominal seat limits
* ``seats.py``     seats from observed LIST response sizes (the formula is documented there)
* ``queueset.py``  one level: shuffle sharding, fair queuing by seats, coalescing, reject reasons
* ``controller.py`` all levels + the LIST byte budget; pure, time passed in
* ``coalesce.py``  which requests may share one upstream call
* ``fanout.py``    one upstream body to many clients with bounded per-client buffers
* ``middleware.py`` the asyncio edge: pipeline middleware, 429s, reloads
* ``loading.py`` / ``settings.py`` / ``defaults.py`` / ``metrics.py``: config, sandbox default, Prometheus

Nothing above ``middleware.py`` touches asyncio or sockets.
"""
