import pytest

from lorakit.hardware.libs import run_check


@pytest.mark.slow
def test_bitsandbytes_really_steps_with_8bit_states_on_this_machine():
    r = run_check("bitsandbytes", "cpu")
    assert r.ok, r.detail
    assert "8-bit states" in r.detail


@pytest.mark.slow
def test_a_crashing_check_is_reported_not_raised():
    r = run_check("no-such-library", "cpu")
    assert r.ok is False and "KeyError" in r.detail
