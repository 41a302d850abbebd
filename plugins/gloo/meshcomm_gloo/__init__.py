"""meshcomm's gloo backend."""
