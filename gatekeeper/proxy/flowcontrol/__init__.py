"""API Priority and Fairness in the proxy, one hop before the apiservers.

Layering, data flowing down. The *core* (objects, policy, seats, queueset,
controller, coalesce) is pure: no asyncio, no sockets, no files, time passed
in; tests/architecture/test_layers.py enforces it. The *edge* (fanout,
middleware, loading, metrics, defaults) adapts it to the asyncio pipeline,
the policy files and Prometheus.

* ``objects.py``   v1 FlowSchema / PriorityLevelConfiguration validation (errors name object and field)
* ``policy.py``    built-in objects, upstream matching rules, nominal seat limits
* ``seats.py``     seats from observed LIST response sizes (the formula is documented there)
* ``listcost.py`` a LIST's cost from its options (limit, selectors, watch cache vs storage)
* ``borrowing.py`` lendable/borrowable seats between levels (upstream's allocation)
* ``queueset.py``  one level: shuffle sharding, fair queuing by seats, coalescing, reject reasons
* ``controller.py`` all levels + the LIST byte budget; pure, time passed in
* ``coalesce.py``  which requests may share one upstream call
* ``fanout.py``    (edge) one upstream body to many clients with bounded per-client buffers
* ``middleware.py`` (edge) the asyncio middleware: 429s, reloads (SIGHUP, file polling)
* ``loading.py`` / ``defaults.py`` / ``metrics.py`` (edge): policy files, the sandbox default
  (``seeds.yaml``, package data), Prometheus
* ``settings.py``  the ``proxy.flowControl`` dataclasses (no I/O)

Worker processes (``gatekeeper proxy --workers N``, ``proxy/workers.py``): seats are
proxy-wide, queues stay per worker (``ledger.py``).

* Choice: a shared-memory seat ledger (an mmap'ed file the supervisor creates)
  instead of a dispatcher process. Each worker keeps its own queues and fair
  queuing; before a request starts, the worker checks and charges the level's
  seats (and the LIST byte budget) for the whole proxy in the ledger under one
  ``fcntl`` record lock, and gives them back (no lock: each worker writes only
  its own column) when the request ends. A level's
  limit is therefore the proxy's limit: the seeds' 2 secret LISTs stay 2 with
  4 workers. Queue-wait timeouts, queue-full and 429s are decided by the
  worker that holds the request, exactly as with one process.
* Cost, measured (``loadtest/bench_ledger.py``, one uncontended worker, 4
  columns): about +10 us per request for a level with free seats on a quiet
  machine (one lock/unlock pair and a scan of N worker columns; admit+finish
  alone is ~15 us), and up to +50 us when the shared machine ran at load
  average 50 (every syscall then cost ~10x), against 600-900 us of proxy CPU
  per small GET; no message to another process, no wait. A dispatcher
  process would cost a round trip (two context switches and a socket
  write/read each way) per request. Exempt requests never touch the ledger.
* Fairness across workers: when other workers have requests waiting in a
  level, a free seat goes to the next waiting worker in round-robin order (the
  one refused wakes it through its datagram socket; a 50 ms poll backs up a
  lost wake-up). Within a worker, fair queuing among flows is unchanged. Since
  the kernel spreads connections over workers, a flood on one connection gets
  at most its worker's share of a contended level.
* A worker that dies (even SIGKILL mid-decision: the kernel drops its record
  lock) has its seats, holders and queue counts zeroed by the supervisor at
  once, and waiting workers are woken.
* Coalescing of identical LISTs works within a worker: requests queued in the
  same worker share one upstream call. Identical LISTs that land in different
  workers (different connections) are separate upstream calls, each taking its
  own seat in the proxy-wide level, so the limit still holds; coalescing just
  saves less (one call per worker instead of one per proxy).
  ``tests/flowcontrol/test_ledger.py`` shows both.

Known limits (deliberate, and where this differs from the apiserver's own APF):

* Borrowing follows upstream (``borrowing.py``: seat-demand statistics every
  ``borrowingAdjustmentSeconds``, one fairFrac allocation of the nominal
  total) among Limited levels only; exempt levels' demand is not counted
  against the others as upstream does.
* Token callers (``gatekeeper.proxy.pipeline.tokens``): ServiceAccount tokens are
  verified locally and classified as the apiserver's user; other tokens via
  optional TokenReview; a token that cannot be verified is ``system:anonymous``
  with one ByUser flow per source address and is never exempt. The identity
  is only for classification and queuing: the token goes upstream untouched
  and the apiserver authenticates it. Impersonation headers are classified
  as the impersonated identity only for callers named in
  ``flowControl.impersonators`` (``pipeline/impersonation.py``); the apiserver
  authorizes impersonation, which the proxy cannot, and classifies everyone
  it lets impersonate as the impersonated identity.
* Seats come from observed response bytes per (resource, namespace) and a
  learnt per-object size, not from object counts (see ``seats.py`` and
  ``listcost.py``); Table responses (``kubectl get``) are learnt as if they
  were the objects.
* One request takes at most its level's maxSeats (upstream's
  ``max(1, min(ceil(0.15 * limit), limit // handSize))``), so in small levels
  the LIST bytes cap, not seats, is what keeps huge LISTs apart.
* Limits are per proxy (all its workers together): N gatekeeper replicas in
  front of the same apiservers admit up to N times each level's seats.
"""
