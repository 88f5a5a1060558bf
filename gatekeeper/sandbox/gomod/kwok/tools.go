//go:build tools

// Package tools pins the KWOK command that the sandbox builds.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
