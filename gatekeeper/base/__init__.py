"""The shared base of every command: typed config loaded from YAML, its errors, and safe YAML files."""
