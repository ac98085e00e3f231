"""Tests for autopar._format: units, mesh and device-id text, runner-up ratios."""
from __future__ import annotations

import pytest

from autopar.core._format import (
    format_bytes,
    format_time,
    id_range,
    mesh_text,
    ratio_text,
    runner_up_text,
)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (5 * 2**20, "5.00 MiB"), (3 * 2**30, "3.00 GiB"), (2 * 2**40, "2.00 TiB"),
    (4096 * 2**40, "4096.00 TiB"), (-1536, "-1.50 KiB"),
])
def test_bytes_format(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize("s, text", [
    (2.5, "2.500 s"), (1.0, "1.000 s"), (0.0025, "2.500 ms"), (1e-3, "1.000 ms"),
    (2.5e-6, "2.5 us"), (0.0, "0.0 us"),
])
def test_time_format(s, text):
    assert format_time(s) == text


def test_mesh_and_device_ids():
    assert mesh_text(("data", "model"), (2, 4)) == "data=2 x model=4"
    assert mesh_text((), ()) == ""
    assert id_range(range(4, 8)) == "4..7" and id_range((0, 1)) == "0, 1"
    assert id_range((0, 2, 5)) == "0, 2, 5" and id_range((3,)) == "3"


def test_ratios_and_runner_ups():
    assert ratio_text(3.0, 2.0) == "1.50" and ratio_text(3.0, 2.0, "x") == "1.50x"
    assert ratio_text(None, 2.0) == "-" and ratio_text(1.0, 0.0) == "-"
    alt = lambda step, fits: {"name": "DataParallel()", "predicted_step_s": step, "fits": fits}
    assert runner_up_text(alt(3.0, True), 2.0) == "DataParallel() 1.50x"
    assert runner_up_text(alt(3.0, False), 2.0) == "DataParallel() 1.50x (over budget)"
    assert runner_up_text(alt(None, False), 2.0) == "DataParallel() over budget"
    assert runner_up_text(alt(None, None), 2.0) == "DataParallel() not priced"
