"""The progress line (``cli/progress.py``): a line per phase with fixed-width fields, true
totals as given, one unit system, and a phase's end said in one line."""

from __future__ import annotations

import io
import re

from gpusnap.cli.progress import ProgressBar

MIB = 1 << 20
ANSI = re.compile(r"\x1b\[K")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _bar(columns: int = 120) -> tuple[ProgressBar, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return (
        ProgressBar("checkpoint J", out, min_interval=0, clock=clock, columns=columns),
        out,
        clock,
    )


def _frames(out: io.StringIO) -> list[str]:
    """Every redraw, as the terminal shows it (the escape that clears the line's end dropped)."""
    return [ANSI.sub("", f).rstrip("\n") for f in out.getvalue().split("\r") if f]


def test_the_line_keeps_its_width_whatever_the_figures() -> None:
    bar, out, clock = _bar()
    bar.phase("upload")
    for done, total in [(0, 10 * MIB), (512, 10 * MIB), (5 * MIB, 10 * MIB), (10 * MIB, 10 * MIB)]:
        clock.now += 1.0
        bar(done, total)
    bar.update(3 * 1024**3, 700 * 1024**3)  # much bigger figures, same widths
    lines = [f for f in _frames(out) if "[" in f]
    assert len({len(f) for f in lines}) == 1, lines
    assert len({f.index("[") for f in lines}) == 1 and len({f.index("]") for f in lines}) == 1


def test_sizes_and_rates_are_in_one_unit_system() -> None:
    bar, out, clock = _bar()
    bar.phase("upload")
    bar(0, 1000 * MIB)
    clock.now += 2.0
    bar(500 * MIB, 1000 * MIB)
    last = _frames(out)[-1]
    assert "500 MiB/1000 MiB" in last.replace("  ", " ").replace(" /", "/")
    assert "250 MiB/s" in last
    assert re.search(r"ETA +0:02\b", last), last  # 500 MiB left at 250 MiB/s
    assert not re.search(r"\b(MB|KB|GB)(/s)?\b", out.getvalue())


def test_a_part_done_is_not_the_end_and_each_phase_gets_its_line() -> None:
    bar, out, clock = _bar()
    bar.phase("dump")
    bar(27 * 1024, 27 * 1024)  # a first, small figure that is all of it: not the end
    clock.now += 1.0
    bar(2 * MIB, 8 * MIB)
    clock.now += 1.0
    bar.phase("upload")  # the dump's line is finished with what it did
    bar(8 * MIB, 8 * MIB)
    clock.now += 0.5
    bar.phase("commit")
    clock.now += 0.25
    bar.close()
    text = ANSI.sub("", out.getvalue())
    finished = [ln.split("\r")[-1] for ln in text.split("\n") if ln]
    assert finished == [
        f"checkpoint J {'dump':<15} 2.00 MiB in 2.0s, 1010 KiB/s",  # moved since the first figure
        f"checkpoint J {'upload':<15} 8.00 MiB in 0.5s, 0 B/s",
        f"checkpoint J {'commit':<15} 0.2s",
    ]


def test_a_phase_without_bytes_shows_its_time() -> None:
    bar, out, clock = _bar()
    bar.phase("freeze-gpu")
    clock.now += 3.5
    bar(0, 0)
    assert _frames(out)[-1] == f"checkpoint J {'freeze-gpu':<15} 3.5s"
