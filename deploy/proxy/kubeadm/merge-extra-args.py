#!/usr/bin/env python3
"""Print a kubeadm ClusterConfiguration with a topology's apiServer.extraArgs merged in (or taken out).

    merge-extra-args.py CLUSTER.yaml topology-b.yaml             > cluster-b.yaml    # add or replace by name
    merge-extra-args.py --remove CLUSTER.yaml topology-b.yaml    > cluster.yaml      # roll back

CLUSTER.yaml is the cluster's own ClusterConfiguration (kubectl -n kube-system get configmap kubeadm-config
-o jsonpath='{.data.ClusterConfiguration}'), kubeadm.k8s.io/v1beta4: extraArgs is a list of {name, value}. Every
other field is kept as it is. Needs Python 3 and PyYAML (the gatekeeper CLI's own dependencies).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml


def merged(cluster: dict[str, Any], change: dict[str, Any], *, remove: bool = False) -> dict[str, Any]:
    for doc in (cluster, change):
        if doc.get("kind") != "ClusterConfiguration" or doc.get("apiVersion") != "kubeadm.k8s.io/v1beta4":
            raise SystemExit(f"expected a kubeadm.k8s.io/v1beta4 ClusterConfiguration, got {doc.get('apiVersion')} "
                             f"{doc.get('kind')}")
    wanted = {a["name"]: str(a["value"]) for a in change["apiServer"]["extraArgs"]}
    api_server = dict(cluster.get("apiServer") or {})
    kept = [a for a in api_server.get("extraArgs") or [] if a["name"] not in wanted]
    api_server["extraArgs"] = kept if remove else [*kept, *({"name": k, "value": v} for k, v in wanted.items())]
    if not api_server["extraArgs"]:
        del api_server["extraArgs"]
    return {**cluster, "apiServer": api_server}


def main(argv: list[str]) -> int:
    remove = "--remove" in argv
    paths = [a for a in argv if a != "--remove"]
    if len(paths) != 2:
        raise SystemExit(__doc__)
    cluster, change = (yaml.safe_load(Path(p).read_text()) for p in paths)
    sys.stdout.write(yaml.safe_dump(merged(cluster, change, remove=remove), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
