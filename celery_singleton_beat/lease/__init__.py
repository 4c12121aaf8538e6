"""Leases on one key: the holder value, the commands and scripts, acquire, keep, release, take over."""
