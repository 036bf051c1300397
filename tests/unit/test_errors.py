from lorakit.errors import ConfigError, InputError, LorakitError, UnknownNameError


def test_exit_codes_bad_input_is_2_failure_is_1():
    assert InputError("x").exit_code == 2
    assert ConfigError(["a: b"]).exit_code == 2
    assert LorakitError("x").exit_code == 1


def test_config_error_names_every_problem():
    e = ConfigError(["lora.rnk: unknown key", "optim.lr: must be > 0, got -1"], source="run.yaml")
    assert "run.yaml" in e.message and "lora.rnk" in e.message and "optim.lr" in e.message
    assert e.to_dict()["problems"] == e.problems


def test_unknown_name_suggests_closest():
    e = UnknownNameError("profile", "rtx4909", ["rtx4090", "rtx5090", "cpu"])
    assert "rtx4909" in e.message
    assert e.hint.startswith("did you mean 'rtx4090'?")
