"""GPU pods: the rewrite policy (``policy``) and its pure parts (sizing, claims, modes, MIG pools)."""
