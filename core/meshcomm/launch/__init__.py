"""``meshcomm launch``: start a job's ranks locally or over ssh, for any backend."""
