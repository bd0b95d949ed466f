"""The progress line on a terminal: what a job (or a store push or pull) is doing, now.

One line per phase: a phase with bytes (dump, upload, fetch) shows a bar, percent, done of its
true total, the rate and the time left; a phase without bytes (freeze-gpu, commit,
restore-process) shows its time so far. When the phase changes its line is finished with what
it did (``dump  980 MiB in 3.1s, 316 MiB/s``) and the next one starts below. One unit system:
sizes in KiB/MiB/GiB and rates in MiB/s (binary), always. Every field has a fixed width and
the bar's width is set once, from the terminal's width at the start, so the line never jumps.

Thread-safe (the store calls ``bar(done, total)`` from its workers); redraws at most every
``min_interval`` seconds, and ``start_ticking`` keeps the time of a phase without news moving.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import TextIO

from gpusnap.cli._output import human_bytes, human_seconds

PHASE_WIDTH = 15  # "restore-process" is the longest phase name
SIZE_WIDTH = 9  # "1023 MiB", "2.85 GiB"
RATE_WIDTH = 11  # "1023 MiB/s"
_MAX_BAR, _MIN_BAR = 30, 10


class ProgressBar:
    """A progress line on ``stream``; call ``phase(name)`` as a job moves, ``bar(done,
    total)`` with its figures, ``close()`` at the end (success or not)."""

    def __init__(
        self,
        label: str,
        stream: TextIO,
        *,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        columns: int | None = None,
    ) -> None:
        self._label = label
        self._stream = stream
        self._min_interval = min_interval
        self._clock = clock
        self._lock = threading.Lock()
        width = columns or shutil.get_terminal_size((100, 24)).columns
        fixed = len(label) + 1 + PHASE_WIDTH + 1 + 2 + len(self._tail(0, 0, 0.0, None))
        self._bar_width = max(_MIN_BAR, min(_MAX_BAR, width - fixed - 2))
        self._phase = ""
        self._phase_start = clock()
        self._first: tuple[float, int] | None = None  # the phase's first figures
        self._done = self._total = 0
        self._last_draw = float("-inf")
        self._drawn = False
        self._closed = False
        self._ticker: threading.Thread | None = None

    # --- what the caller reports ---------------------------------------------------------

    def __call__(self, done: int, total: int) -> None:
        self.update(done, total)

    def phase(self, name: str) -> None:
        """The job is now in phase ``name``: finish the line of the one before."""
        with self._lock:
            if self._closed or name == self._phase:
                return
            if self._phase:
                self._draw(final=True)
            self._phase, self._phase_start = name, self._clock()
            self._first, self._done, self._total = None, 0, 0
            self._draw()

    def update(self, done: int, total: int) -> None:
        now = self._clock()
        with self._lock:
            if self._closed:
                return
            if self._first is None and total > 0:
                self._first = (now, done)
            self._done, self._total = max(0, done), max(0, total)
            if now - self._last_draw >= self._min_interval or (total and done >= total):
                self._draw()  # a figure that completes the total is always shown

    def start_ticking(self, every: float = 0.5) -> None:
        """Redraw every ``every`` seconds, so a phase that reports nothing shows its time."""

        def run() -> None:
            while True:
                time.sleep(every)
                with self._lock:
                    if self._closed:
                        return
                    self._draw()

        self._ticker = threading.Thread(target=run, name="progress-tick", daemon=True)
        self._ticker.start()

    def close(self) -> None:
        """Finish the line (idempotent)."""
        with self._lock:
            if self._closed:
                return
            if self._drawn:
                self._draw(final=True)
            self._closed = True

    # --- drawing -------------------------------------------------------------------------

    def _rate(self, now: float) -> float | None:
        if self._first is None:
            return None
        since, base = self._first
        return (self._done - base) / (now - since) if now - since >= 0.2 else None

    def _tail(self, done: int, total: int, elapsed: float, rate: float | None) -> str:
        pct = f"{min(100.0, 100.0 * done / total):5.1f}%" if total else " " * 6
        rate_text = f"{human_bytes(rate)}/s" if rate is not None else "-"
        eta = "-"
        if rate and total > done:
            eta = human_seconds((total - done) / rate)
        elif total and done >= total:
            eta = human_seconds(elapsed)
        return (
            f" {pct}  {human_bytes(done):>{SIZE_WIDTH}}/{human_bytes(total):<{SIZE_WIDTH}}"
            f"  {rate_text:>{RATE_WIDTH}}  {'ETA' if total > done else 'in '} {eta:>7}"
        )

    def _draw(self, *, final: bool = False) -> None:
        now = self._clock()
        self._last_draw = now
        elapsed = now - self._phase_start
        head = f"{self._label} {self._phase:<{PHASE_WIDTH}}"
        if self._total > 0:
            frac = min(1.0, self._done / self._total)
            filled = int(frac * self._bar_width)
            bar = "#" * filled + "." * (self._bar_width - filled)
            line = f"{head} [{bar}]{self._tail(self._done, self._total, elapsed, self._rate(now))}"
            if final:
                moved = self._done - (self._first[1] if self._first else 0)
                rate = moved / elapsed if elapsed > 0 else 0.0
                line = f"{head} {human_bytes(self._done)} in {elapsed:.1f}s, {human_bytes(rate)}/s"
        else:
            line = f"{head} {elapsed:.1f}s"
        self._stream.write(f"\r{line}\x1b[K" + ("\n" if final else ""))
        self._stream.flush()
        self._drawn = not final
