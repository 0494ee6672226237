"""Storage: fsspec reads and writes with retries, and the local shard cache."""
