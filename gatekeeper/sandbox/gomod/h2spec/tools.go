//go:build tools

// Package tools pins h2spec, the HTTP/2 conformance checker run against the proxy by tests/proxy/test_h2spec.py.
package tools

import _ "github.com/summerwind/h2spec/cmd/h2spec"
