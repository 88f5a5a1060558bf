"""API Priority and Fairness in the proxy, one hop before the apiservers.

Layering, data flowing down:

* ``objects.py``   v1 FlowSchema / PriorityLevelConfiguration validation (errors name object and field)
* ``policy.py``    built-in objects, upstream matching rules, nominal seat limits
* ``seats.py``     seats from observed LIST response sizes (the formula is documented there)
* ``listcost.py`` a LIST's cost from its options (limit, selectors, watch cache vs storage)
* ``borrowing.py`` lendable/borrowable seats between levels (upstream's allocation)
* ``queueset.py``  one level: shuffle sharding, fair queuing by seats, coalescing, reject reasons
* ``controller.py`` all levels + the LIST byte budget; pure, time passed in
* ``coalesce.py``  which requests may share one upstream call
* ``fanout.py``    one upstream body to many clients with bounded per-client buffers
* ``middleware.py`` the asyncio edge: pipeline middleware, 429s, reloads
* ``loading.py`` / ``settings.py`` / ``defaults.py`` / ``metrics.py``: config, sandbox default, Prometheus

Nothing above ``middleware.py`` touches asyncio or sockets.

Known limits (deliberate, and where this differs from the apiserver's own APF):

* Borrowing follows upstream (``borrowing.py``: seat-demand statistics every
  ``borrowingAdjustmentSeconds``, one fairFrac allocation of the nominal
  total) among Limited levels only; exempt levels' demand is not counted
  against the others as upstream does.
* Token callers (``gatekeeper.proxy.identity``): ServiceAccount tokens are
  verified locally and classified as the apiserver's user; other tokens via
  optional TokenReview; a token that cannot be verified is ``system:anonymous``
  with one ByUser flow per source address and is never exempt. The identity
  is only for classification and queuing: the token goes upstream untouched
  and the apiserver authenticates it. Impersonation headers are not
  classified as the impersonated user (the apiserver authorizes them later).
* Seats come from observed response bytes per (resource, namespace) and a
  learnt per-object size, not from object counts (see ``seats.py`` and
  ``listcost.py``); Table responses (``kubectl get``) are learnt as if they
  were the objects.
* One request takes at most its level's maxSeats (upstream's
  ``max(1, min(ceil(0.15 * limit), limit // handSize))``), so in small levels
  the LIST bytes cap, not seats, is what keeps huge LISTs apart.
* Limits are per proxy process: N gatekeeper replicas in front of the same
  apiservers admit up to N times each level's seats.
"""
