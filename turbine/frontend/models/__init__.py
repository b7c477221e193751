"""What the frontend knows per served model, from discovery: the model table (table.py), the global
router's pools (pools.py), decode workers' likely caches (decode_cache.py)."""
