"""Certificates for a cluster and for gatekeeper itself: the PKI and the `gatekeeper certs` command."""
