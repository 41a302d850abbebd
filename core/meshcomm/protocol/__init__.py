"""The protocol layer: what a transport is and does (the ``Backend`` protocol, the generic
algorithms over send/recv, the operation table, dtypes, errors). It imports nothing of
meshcomm above it; the layers above import it (docs/layout.md)."""
