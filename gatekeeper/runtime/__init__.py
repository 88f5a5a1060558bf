"""What a running process needs whatever it serves: logs, metrics (and their multiprocess directory),
the operational endpoints, private temporary directories, and which modules load compiled."""
