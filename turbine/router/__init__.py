"""KV-cache-aware routing: block hashing, the KV indexer, load tracking and the cost function."""
