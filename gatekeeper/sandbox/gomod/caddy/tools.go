//go:build tools

// Package tools pins Caddy, the Go reverse proxy `python -m loadtest bench proxy` compares the proxy with.
package tools

import _ "github.com/caddyserver/caddy/v2/cmd/caddy"
