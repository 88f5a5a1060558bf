"""Who a bearer-token caller is, for flow control only (docs/flowcontrol/tokens.md).

The ``Authorization`` header goes upstream untouched and the apiserver authenticates it; this estimate only lets
FlowSchemas match token callers as kube-apiserver's APF does, without letting made-up tokens mint flows. Every module
but ``fetch.py`` is pure."""
