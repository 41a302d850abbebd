"""The API layer: what users call (groups and their operations, ``init``, handles, the
one-thread guard, call checks, the observer slot tools attach to). It imports the protocol
and runtime layers; users reach it through :mod:`meshcomm` (docs/layout.md)."""
