"""Talking to Redis: URLs, Sentinel and Cluster clients, the wire protocol, per-thread channels, redirects."""
