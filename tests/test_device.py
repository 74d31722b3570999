"""Device choice: CPU + gloo without accelerators; the env override is validated."""

import pytest

from omniweave import device


def test_cpu_override_picks_gloo(monkeypatch):
    monkeypatch.setenv("OMNIWEAVE_DEVICE", "cpu")
    info = device.detect()
    assert (info.type, info.backend) == ("cpu", "gloo")
    assert str(info.device(3)) == "cpu"


def test_bad_override_is_rejected(monkeypatch):
    monkeypatch.setenv("OMNIWEAVE_DEVICE", "tpu9")
    with pytest.raises(ValueError, match="tpu9"):
        device.detect()


def test_peak_memory_is_positive():
    assert device.peak_memory_bytes(device.detect("cpu")) > 0
