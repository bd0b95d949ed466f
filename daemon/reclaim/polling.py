"""``poll_until_stopped``: the loop of reclaim's background lookers (standby, prefetch).

Each looks at the store every ``interval`` seconds; a look that fails is logged and kept as
the looker's ``last_error`` (what ``gpusnap triggers`` shows), and the next look goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpusnap.errors import GpusnapError

log = logging.getLogger(__name__)


def poll_until_stopped(
    tick: Callable[[], object],
    stop: threading.Event,
    interval: Callable[[], float],
    set_error: Callable[[str | None], None],
    what: str,
) -> None:
    """Run ``tick`` every ``interval()`` seconds until ``stop``; each look's error (``None``
    after one that worked) goes to ``set_error``."""
    while not stop.is_set():
        try:
            tick()
            set_error(None)
        except GpusnapError as exc:
            set_error(str(exc))
            log.warning("%s: %s", what, exc)
        except Exception as exc:
            set_error(f"{type(exc).__name__}: {exc}")
            log.exception("%s failed", what)
        stop.wait(interval())
