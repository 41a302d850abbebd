"""meshcomm's gloo backend: gloo collectives through torch.distributed's ProcessGroupGloo.

The plugin registers from :mod:`meshcomm_gloo.plugin`; torch is imported only when the
backend starts.
"""

__all__: list[str] = []
