"""The TLS server plumbing the webhook and the proxy share: listener settings, binding, accepting,
handshakes under a deadline and TLS contexts that follow their files."""
