"""gatekeeper: admission webhook and API-aware front proxy for Kubernetes control planes."""

__version__ = "0.1.0"
