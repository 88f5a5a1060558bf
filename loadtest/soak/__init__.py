"""The proxy's memory under a long steady load (issue 46): ``python -m loadtest bench soak``."""
