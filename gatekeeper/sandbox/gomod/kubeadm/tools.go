//go:build tools

// Package tools pins kubeadm, built from the same Kubernetes module and version as the sandbox's binaries.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kubeadm"
)
