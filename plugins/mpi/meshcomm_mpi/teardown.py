"""mpiexec's teardown, heard by a waiting rank.

When a rank's process dies, Open MPI's mpiexec sends every other rank SIGTERM about 0.25 s
later and SIGKILL 0.25 s after that. A survivor waiting for the dead rank looks at its
local peers every 0.1 s, but on a loaded host it may not run before the SIGTERM: it would
end without a word. :class:`TermWatch` turns that SIGTERM, while the rank waits in an
operation, into a look at once, so the wait raises PeerLostError naming the dead rank;
outside a wait, a dead local peer is raised at once (as SIGINT raises KeyboardInterrupt
wherever the program is). With no dead peer in sight the signal does what it did before.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["TermWatch"]


class TermWatch:
    """A SIGTERM handler that lets a waiting rank look at its peers before it ends."""

    def __init__(self) -> None:
        #: a SIGTERM arrived while a wait was running: it looks at its peers now, then
        #: calls :meth:`pass_on` unless it raised
        self.heard = False
        self._previous: Any = None
        self._installed = False

    def install(self, waiting: Callable[[], bool], lost: Callable[[], BaseException | None]) -> None:
        """Handle SIGTERM from now on (main thread only; elsewhere nothing changes):
        ``waiting()`` says whether a wait loop runs to look at the peers; outside one,
        ``lost()`` is the error to raise for a dead peer (None: pass the signal on)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is None:  # a handler not installed from Python: leave it
            return

        def on_term(signum: int, frame: FrameType | None) -> None:
            if self.heard:  # a second one: end now
                self.pass_on()
            elif waiting():
                self.heard = True
            else:
                exc = lost()
                if exc is None:
                    self.pass_on()
                    return
                self.uninstall()  # the next SIGTERM ends the process
                raise exc

        self._previous = previous
        signal.signal(signal.SIGTERM, on_term)
        self._installed = True

    def pass_on(self) -> None:
        """Do what SIGTERM did before :meth:`install`: the previous handler, or the default
        action (the process ends by the signal, as mpiexec expects)."""
        self.heard = False
        previous = self._previous
        self.uninstall()
        if callable(previous):
            previous(signal.SIGTERM, None)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)

    def uninstall(self) -> None:
        """Put the previous SIGTERM handler back (if this one is still installed)."""
        if not self._installed:
            return
        self._installed = False
        try:
            signal.signal(signal.SIGTERM, self._previous)
        except (ValueError, TypeError):  # not the main thread: leave ours (it passes on)
            pass
