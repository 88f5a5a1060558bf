"""One module per seed claim; each exposes ``run(ctx) -> None`` and ``CLAIM`` (the seed's words and figure)."""
