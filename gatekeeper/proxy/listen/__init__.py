"""The client side of the proxy: TLS listener with ALPN, and the HTTP/2 and HTTP/1.1 adapters that turn bytes into a
ProxyRequest and a ProxyResponse back into bytes."""
