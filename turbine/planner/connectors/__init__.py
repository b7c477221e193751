"""Connectors by name (`--connector NAME` imports `NAME.py` here): local, kubernetes, virtual."""
