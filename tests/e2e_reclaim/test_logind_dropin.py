"""The logind drop-in shipped for the shutdown path gives the reclaim checkpoint its time."""

from __future__ import annotations

import configparser
from pathlib import Path

from gpusnap.daemon.reclaim.runtime import STOP_RECLAIM_BUDGET_S

DROPIN = Path(__file__).resolve().parents[2] / "systemd" / "gpusnapd-logind.conf"


def test_logind_dropin_raises_the_inhibit_delay_to_the_daemons_stop_budget() -> None:
    parser = configparser.ConfigParser(strict=True, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(DROPIN.read_text())
    assert parser.sections() == ["Login"]
    assert dict(parser["Login"]) == {"InhibitDelayMaxSec": str(int(STOP_RECLAIM_BUDGET_S))}


def test_logind_dropin_explains_that_kubelet_shares_the_setting() -> None:
    text = DROPIN.read_text()
    assert "shutdownGracePeriod" in text
    assert "99-kubelet.conf" in text
