//go:build tools

// Package tools pins the helm command that the suite uses for `helm lint` and `helm template`.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
