"""Remote files: the local-disk cache, its checks and locks, fetching a URL, the shards of the next steps."""
