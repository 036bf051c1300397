"""bitsandbytes is left out of a `lorakit train`, `cache` or `infer` process whose run does not use it, and only
there."""

import json
import subprocess
import sys

import pytest
import yaml

from lorakit.errors import STOP
from lorakit.plan.memory import needs_bitsandbytes
from lorakit.unused import leave_out_bitsandbytes, saved_by_bitsandbytes
from tests.unit.train.test_loop import make_cfg

# the command as the console script runs it, saying at exit which bitsandbytes modules the process imported
_COMMAND = """
import atexit, sys
atexit.register(lambda: print("BNB", sorted(m for m, v in sys.modules.items()
                                            if m.startswith("bitsandbytes") and v is not None), file=sys.stderr))
sys.argv = ["lorakit", *sys.argv[1:]]
from lorakit.cli.entry import main
main()
"""


def _bnb_modules(stderr: str) -> list:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("BNB "))
    return eval(line[4:])  # noqa: S307 - the list this test's own process printed


@pytest.mark.slow
def test_a_train_or_infer_process_leaves_bitsandbytes_out_where_its_run_does_not_use_it(tmp_path, tiny):
    # (a run that uses it keeps it: the 8-bit AdamW runs of tests/unit/test_dist.py are such processes, and
    # test_what_a_run_uses_decides the decision; one here would compile bitsandbytes' CPU kernels from a cold
    # compile cache, ~100 s of CI's time)
    cfg = make_cfg(tmp_path / "a", "flux", tiny("flux"), steps=2, sampling={"enabled": False})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    r = subprocess.run([sys.executable, "-c", _COMMAND, "train", str(path), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["steps"] == 2 and _bnb_modules(r.stderr) == []  # trained, and never imported it
    # sampling with the LoRA (peft's adapter layers, without its bitsandbytes ones) never imports it either
    r = subprocess.run([sys.executable, "-c", _COMMAND, "infer", str(tiny("flux")), "-p", "a cat", "--steps", "1",
                        "--width", "64", "--height", "64", "--device", "cpu", "--dtype", "fp32", "--lora",
                        res["lora"], "-o", str(tmp_path / "images"), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads(r.stdout)["files"]) == 1 and _bnb_modules(r.stderr) == []


def test_what_a_run_uses_decides(tmp_path, tiny):
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2)
    assert not needs_bitsandbytes(cfg)
    assert needs_bitsandbytes(make_cfg(tmp_path, "flux", tiny("flux"), steps=2, optim={"name": "adamw8bit"}))
    assert needs_bitsandbytes(make_cfg(tmp_path, "flux", tiny("flux"), steps=2, memory={"optimizer_8bit": True}))
    assert needs_bitsandbytes(make_cfg(tmp_path, "flux", tiny("flux"), steps=2, memory={"base_quant": "nf4"}))


def test_a_component_saved_quantized_by_bitsandbytes_keeps_it(tmp_path):
    (tmp_path / "text_encoder_2").mkdir()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"num_layers": 2}))
    assert not saved_by_bitsandbytes(tmp_path) and not saved_by_bitsandbytes(None)
    (tmp_path / "text_encoder_2" / "config.json").write_text("{not json")  # unreadable: not a declaration
    assert not saved_by_bitsandbytes(tmp_path)
    (tmp_path / "text_encoder_2" / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}))
    assert saved_by_bitsandbytes(tmp_path)


def test_only_a_process_of_lorakits_own_leaves_it_out(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    monkeypatch.setitem(STOP, "entry", False)  # typer's test runner in this process: its modules are its own
    assert not leave_out_bitsandbytes(False) and "bitsandbytes" not in sys.modules
    monkeypatch.setitem(STOP, "entry", True)
    assert not leave_out_bitsandbytes(True) and "bitsandbytes" not in sys.modules  # the run uses it
    saved = tmp_path / "text_encoder"
    saved.mkdir()
    (saved / "config.json").write_text(json.dumps({"quantization_config": {"load_in_8bit": True}}))
    assert not leave_out_bitsandbytes(False, tmp_path) and "bitsandbytes" not in sys.modules  # its model needs it
    assert leave_out_bitsandbytes(False, tmp_path / "elsewhere")
    assert importlib.util.find_spec("bitsandbytes") is None  # what peft's and diffusers' checks ask
    with pytest.raises(ImportError):
        import bitsandbytes  # noqa: F401


def test_resolve_settles_the_config_before_its_plan_imports_a_model_library(tmp_path, tiny, monkeypatch):
    # on a GPU with compiled blocks the plan imports diffusers (and peft, and bitsandbytes with them): what the
    # run leaves out is decided before that, from the config with its model folder and the profile's settings
    import lorakit.plan.resolve as resolve_mod

    order = []
    plan_run = resolve_mod.plan_run
    monkeypatch.setattr(resolve_mod, "plan_run", lambda *a, **k: (order.append("plan"), plan_run(*a, **k))[1])
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=2, optim={"name": "adamw8bit"})
    r = resolve_mod.resolve(cfg, settled=lambda c: order.append(("settled", needs_bitsandbytes(c), c.model.path)))
    assert order == [("settled", True, r.cfg.model.path), "plan"]
