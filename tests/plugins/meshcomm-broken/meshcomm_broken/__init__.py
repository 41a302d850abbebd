"""Fails on import, like a plugin whose native library is missing."""

raise ImportError("libbroken.so.1: cannot open shared object file")
