import pytest

from lorakit.errors import UnknownNameError
from lorakit.hardware.profiles import choose, load_profile, profile_names
from tests.machines import CPU_ONLY, DGX_SPARK, H100, H200, RTX3060_12GB, RTX4090, RTX5090


@pytest.mark.parametrize("facts,name,reason_bit", [
    (DGX_SPARK, "dgx-spark", "unified memory"),
    (RTX4090, "rtx4090", "under 30 GiB"),
    (RTX5090, "rtx5090", "30-70 GiB"),
    (H100, "datacenter", "70 GiB or more"),
    (H200, "datacenter", "70 GiB or more"),
    (CPU_ONLY, "cpu", "no CUDA GPU"),
])
def test_auto_picks_the_right_profile_and_says_why(facts, name, reason_bit):
    c = choose("auto", facts)
    assert c.profile.name == name
    assert reason_bit in c.reason
    assert c.warnings == []


def test_12gb_card_gets_smallest_profile_with_a_warning():
    c = choose("auto", RTX3060_12GB)
    assert c.profile.name == "rtx4090"
    assert len(c.warnings) == 1 and "12 GiB" in c.warnings[0] and "at least 22 GiB" in c.warnings[0]


def test_dgx_spark_profile_on_discrete_gpu_warns():
    c = choose("dgx-spark", H100)
    assert any("discrete GPU" in w for w in c.warnings)


def test_discrete_profile_on_unified_memory_warns():
    c = choose("rtx4090", DGX_SPARK)
    assert any("shares memory with the CPU" in w for w in c.warnings)


def test_gpu_profile_without_gpu_warns():
    c = choose("datacenter", CPU_ONLY)
    assert c.warnings and "needs a CUDA GPU" in c.warnings[0]


def test_unknown_profile_lists_valid_names():
    with pytest.raises(UnknownNameError) as ei:
        choose("rtx4909", H100)
    assert "rtx4090" in ei.value.hint and "auto" in ei.value.hint


def test_profiles_are_data_with_the_promised_settings():
    assert profile_names() == ["dgx-spark", "rtx4090", "rtx5090", "datacenter", "cpu"]
    spark = load_profile("dgx-spark").defaults["memory"]
    assert spark["pin_memory"] is False and spark["cpu_offload"] is False and spark["unified_memory"] is True
    assert spark["base_quant"] == "none" and spark["expandable_segments"] is True
    r4090 = load_profile("rtx4090").defaults
    assert r4090["memory"]["base_quant"] == "qfloat8" and r4090["optim"]["name"] == "adamw8bit"
    assert r4090["memory"]["gradient_checkpointing"] is True
    assert load_profile("rtx5090").defaults["memory"]["base_quant"] == "fp8"
    # compiled blocks over the 8-bit base on the small discrete cards (FLUX under 24 GiB 0.960 -> 0.613 s/step)
    assert r4090["memory"]["compile"] is True and load_profile("rtx5090").defaults["memory"]["compile"] is True
    assert spark["compile"] is False  # unmeasured there
    dc = load_profile("datacenter").defaults["memory"]
    assert dc["base_quant"] == "none" and dc["compile"] is True


def test_every_profile_validates_as_config_defaults():
    from lorakit.config import deep_merge, validate

    for name in profile_names():
        cfg = validate(deep_merge(load_profile(name).defaults, {"model": {"family": "flux"}}))
        assert cfg.model.family == "flux"
