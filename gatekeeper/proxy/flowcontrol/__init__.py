"""API Priority and Fairness in the proxy, one hop before the apiservers.

Layering, data flowing down. The *core* (objects, policy, seats, queueset,
controller, coalesce) is pure: no asyncio, no sockets, no files, time passed
in; tests/architecture/test_layers.py enforces it. The *edge* (fanout,
middleware, loading, metrics, defaults) adapts it to the asyncio pipeline,
the policy files and Prometheus.

* ``objects.py``   v1 FlowSchema / PriorityLevelConfiguration validation (errors name object and field)
* ``policy.py``    built-in objects, upstream matching rules, nominal seat limits
* ``seats.py``     seats from observed LIST response sizes (the formula is documented there)
* ``queueset.py``  one level: shuffle sharding, fair queuing by seats, coalescing, reject reasons
* ``controller.py`` all levels + the LIST byte budget; pure, time passed in
* ``coalesce.py``  which requests may share one upstream call
* ``fanout.py``    (edge) one upstream body to many clients with bounded per-client buffers
* ``middleware.py`` (edge) the asyncio middleware: 429s, reloads (SIGHUP, file polling)
* ``loading.py`` / ``defaults.py`` / ``metrics.py`` (edge): policy files, the sandbox default
  (``seeds.yaml``, package data), Prometheus
* ``settings.py``  the ``proxy.flowControl`` dataclasses (no I/O)

Known limits (deliberate, and where this differs from the apiserver's own APF):

* Borrowing is not implemented: ``lendablePercent`` and ``borrowingLimitPercent``
  are validated (range-checked, so pasted objects load) but ignored; every
  Limited level always has exactly its nominal seats,
  ``ceil(serverConcurrencyLimit * shares / sum of shares)``.
* The proxy knows only what the connection proves: a client-certificate
  caller's user name and groups (O=). A bearer-token caller, including every
  in-cluster ServiceAccount token, is the user ``token:<sha256 prefix>`` with no
  groups, so in practice ``ServiceAccount`` and named ``User``/``Group`` subjects
  never match it; token callers fall through to rules with ``Group *`` or ``User *``
  (ByUser still tells token callers apart). Impersonation headers are not
  classified as the impersonated user (the apiserver authorizes them later).
* Seats come from observed response bytes per (resource, namespace), not from
  object counts, and a LIST with a selector is charged like the unfiltered
  LIST of the same resource and namespace (see ``seats.py``).
* One request takes at most its level's maxSeats (upstream's
  ``max(1, min(ceil(0.15 * limit), limit // handSize))``), so in small levels
  the LIST bytes cap, not seats, is what keeps huge LISTs apart.
* Limits are per proxy process: N gatekeeper replicas in front of the same
  apiservers admit up to N times each level's seats.
"""
