"""meshcomm's sockets backend."""
