"""The dispatch stage: a prepared request goes to workers and their outputs come back (stage.py):
routing, retries, remote prefill (disagg.py) and encode (encode.py) hand-offs, migration, busy queues."""
