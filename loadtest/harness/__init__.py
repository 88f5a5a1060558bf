"""What every scenario shares: the sandbox, tenants, Locust in a child process, /proc and /metrics sampling,
and the report (markdown, CSV, PNG)."""
