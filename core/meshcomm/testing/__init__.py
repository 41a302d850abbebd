"""Tools for testing meshcomm and its backends (the conformance kit lives here)."""
