"""What the lock Redis is and whether it may have lost locks: server record, window, start-up checks."""
