import pytest
import yaml

from lorakit.config import Config, assemble, deep_merge, dump_yaml, parse_overrides, validate
from lorakit.errors import ConfigError
from tests.machines import CPU_ONLY, H100, RTX4090


def write(tmp_path, data, name="run.yaml"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def test_defaults_fill_every_section():
    cfg = validate({"model": {"family": "flux"}})
    assert cfg.lora.rank == 16 and cfg.optim.name == "adamw" and cfg.data.resolution == 1024
    assert cfg.memory.base_quant == "none"


def test_two_mistakes_one_message_naming_both_paths(tmp_path):
    p = write(tmp_path, {"model": {"family": "flux"}, "lora": {"rnk": 4, "rank": "big"}})
    with pytest.raises(ConfigError) as ei:
        assemble(p, [], "cpu", CPU_ONLY)
    e = ei.value
    assert len(e.problems) == 2
    joined = " | ".join(e.problems)
    assert "lora.rnk: unknown key (did you mean 'rank'?)" in joined
    assert "lora.rank:" in joined and "'big'" in joined


def test_every_error_reported_at_once_including_set_syntax(tmp_path):
    p = write(tmp_path, {"model": {"family": "flx"}, "data": {"resolution": 1000}, "bogus": 1})
    with pytest.raises(ConfigError) as ei:
        assemble(p, ["noequals"], "cpu", CPU_ONLY)
    probs = ei.value.problems
    assert any(s.startswith("--set 'noequals'") for s in probs)
    assert any("model.family: unknown family (did you mean 'flux'?)" in s for s in probs)
    assert any("data.resolution: must be a multiple of 16 (try 1008 or 992), got 1000" in s for s in probs)
    assert any(s.startswith("bogus: unknown key") for s in probs)
    assert len(probs) == 4


def test_precedence_defaults_profile_yaml_set(tmp_path):
    # rtx4090 profile sets optim.name=adamw8bit and memory.gradient_checkpointing=true
    p = write(tmp_path, {"model": {"family": "flux"}, "memory": {"gradient_checkpointing": False},
                         "lora": {"rank": 8}})
    cfg, prov = assemble(p, ["lora.rank=32"], "rtx4090", RTX4090)
    assert prov["profile"] == "rtx4090"
    assert cfg.optim.name == "adamw8bit"  # profile beats default
    assert cfg.memory.base_quant == "qfloat8"  # profile beats default
    assert cfg.memory.gradient_checkpointing is False  # YAML beats profile
    assert cfg.lora.rank == 32  # --set beats YAML
    assert cfg.lora.dropout == 0.0  # default where nobody said anything


def test_profile_key_in_yaml_and_cli_override(tmp_path):
    p = write(tmp_path, {"profile": "rtx4090", "model": {"family": "flux"}})
    assert assemble(p, [], None, H100)[0].profile == "rtx4090"
    assert assemble(p, [], "datacenter", H100)[0].profile == "datacenter"


def test_auto_profile_uses_probe(tmp_path):
    p = write(tmp_path, {"model": {"family": "qwen-image"}})
    cfg, prov = assemble(p, [], "auto", H100)
    assert cfg.profile == "datacenter" and "70 GiB or more" in prov["reason"]


def test_set_values_parse_as_yaml():
    out, problems = parse_overrides(["lora.rank=32", "optim.lr=2e-4", "lora.targets=[to_q, to_k]",
                                     "optim.max_grad_norm=null", "data.trigger=sks dog"])
    assert not problems
    assert out["lora"] == {"rank": 32, "targets": ["to_q", "to_k"]}
    assert out["optim"] == {"lr": 2e-4, "max_grad_norm": None}
    assert out["data"]["trigger"] == "sks dog"


def test_yaml_syntax_error_reports_line(tmp_path):
    p = write(tmp_path, "model:\n  family: flux\n lora: [\n")
    with pytest.raises(ConfigError) as ei:
        assemble(p, [], "cpu", CPU_ONLY)
    assert "line" in ei.value.message and str(p) in ei.value.message


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        assemble(tmp_path / "nope.yaml", [], "cpu", CPU_ONLY)
    with pytest.raises(ConfigError, match="must be a mapping"):
        assemble(write(tmp_path, "- a\n- b\n"), [], "cpu", CPU_ONLY)


def test_missing_family_is_named():
    with pytest.raises(ConfigError) as ei:
        validate({"lora": {"rank": 4}})
    assert ei.value.problems == ["model: required but missing"]


def test_targets_preset_or_list_and_bad_values():
    assert validate({"model": {"family": "flux"}, "lora": {"targets": ["to_q", "to_v"]}}).lora.targets == [
        "to_q", "to_v"]
    with pytest.raises(ConfigError) as ei:
        validate({"model": {"family": "flux"}, "lora": {"targets": "everything", "dropout": 1.5},
                  "schedule": {"steps": 10, "warmup_steps": 20}, "optim": {"lr": -1}})
    paths = sorted(p.split(":")[0] for p in ei.value.problems)
    assert "lora.dropout" in paths and "optim.lr" in paths and "schedule" in paths
    assert any(p.startswith("lora.targets") for p in paths)


def test_dump_roundtrips():
    cfg = validate({"model": {"family": "qwen-image-edit", "path": "/m"}, "data": {"dirs": "/d"}})
    again = Config.model_validate(yaml.safe_load(dump_yaml(cfg)))
    assert again == cfg
    assert again.data.dirs[0].as_posix() == "/d"


def test_deep_merge_does_not_mutate():
    a = {"x": {"y": 1, "z": 2}}
    b = {"x": {"y": 3}}
    assert deep_merge(a, b) == {"x": {"y": 3, "z": 2}}
    assert a == {"x": {"y": 1, "z": 2}}


def test_configuration_reference_is_generated_from_the_models():
    from pathlib import Path

    from lorakit.config.docs import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == render(), "run `python -m lorakit.config.docs` to regenerate docs/configuration.md"


def test_option_conflicts_are_config_problems_reported_together():
    with pytest.raises(ConfigError) as ei:
        validate({"model": {"family": "flux"}, "method": "full",
                  "memory": {"base_quant": "nf4", "blocks_to_swap": 2}})
    probs = ei.value.problems
    assert len(probs) == 3  # full+swap, full+8/4-bit base, nf4+swap: each its own line naming its keys
    assert any(p.startswith("memory.blocks_to_swap=2") for p in probs)
    assert any(p.startswith("memory.base_quant=nf4 stores") for p in probs)
    assert any("nf4 with memory.blocks_to_swap" in p for p in probs)


def test_output_name_is_a_file_name_never_a_path_out_of_output_dir():
    import pytest

    from lorakit.config import validate
    from lorakit.errors import ConfigError

    assert validate({"model": {"family": "flux"}, "output": {"name": "my.lora-v2"}}).output.name == "my.lora-v2"
    for bad in ("../../escape", "a/b", "..", ".hidden", "x\\y", "", "x" * 201):
        with pytest.raises(ConfigError, match="output.name: a file name, not a path"):
            validate({"model": {"family": "flux"}, "output": {"name": bad}})


def test_a_problem_a_set_value_gave_is_said_as_the_set_values(tmp_path):
    import pytest

    from lorakit.config import assemble
    from lorakit.errors import ConfigError

    (tmp_path / "my.yaml").write_text("model:\n  family: flux\nschedule:\n  steps: -1\n")
    with pytest.raises(ConfigError) as e:
        assemble(tmp_path / "my.yaml", ["lora.rank=0"], "cpu")
    msg = e.value.message
    assert f"config in {tmp_path / 'my.yaml'} and the --set values: 2 problems" in msg
    assert "lora.rank: " in msg and "(--set lora.rank=0)" in msg and "schedule.steps" in msg
    (tmp_path / "ok.yaml").write_text("model:\n  family: flux\n")
    with pytest.raises(ConfigError, match=r"^config in the --set values: lora.rank: .*\(--set lora.rank=0\)"):
        assemble(tmp_path / "ok.yaml", ["lora.rank=0"], "cpu")
