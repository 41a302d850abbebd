"""Observability (issue 19): a per-rank operation recorder, the merged Chrome/Perfetto
trace, a per-operation summary with an optional PNG, and the stall inspector.

* :mod:`.recorder` records every operation when ``MESHCOMM_TRACE`` or the stall
  inspector is on (the core's only hook: the observer slot, :mod:`meshcomm.api.observer`,
  which the groups' operations run through);
* :mod:`.progress` and :mod:`.stall`: what each rank is doing, and the warning a stalled
  rank logs about the ranks that have not joined;
* :mod:`.chrome` merges the ranks' files into one trace-event JSON file;
* :mod:`.summary` and :mod:`.plot`: ``meshcomm trace summary FILE [--plot PNG]``.

Importing this package is cheap: the core imports it on every start.
"""

__all__: list[str] = []
