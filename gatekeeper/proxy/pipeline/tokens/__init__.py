"""Who a bearer-token caller is, for flow control only.

The proxy passes every ``Authorization`` header upstream untouched and the
apiserver authenticates it; nothing here grants or asserts anything. What this
package adds is an *estimate* of the identity the apiserver will find, so that
FlowSchemas with ServiceAccount, User and Group subjects match token callers the
way kube-apiserver's own APF matches them, and so that fair queuing tells real
callers apart without letting made-up tokens mint flows.

Layering (pure modules import no asyncio and do no I/O; they can move to a core
package as they are):

* ``jwt.py``        compact JWS parsing, JWKS keys, signature and claim checks, the
                    ServiceAccount claim mapping (pure)
* ``review.py``     TokenReview request/response shapes and the per-second budget (pure)
* ``cache.py``      bounded caches keyed by a token digest, expiring with the token (pure)
* ``classify.py``   from an Authorization header to the identity flow control uses (pure)
* ``settings.py``   ``proxy.flowControl.tokens``
* ``fetch.py``      the asyncio edge: JWKS discovery/refresh and TokenReview calls
                    through the proxy's own upstream clients
* ``metrics.py``    Prometheus counters
"""
