"""The runtime layer: the plugin system (hooks, registry, the size-1 backend), settings,
placement, the job secret, how a rank ends, and what launchers and backends agree on. It
imports the protocol layer only (docs/layout.md)."""
