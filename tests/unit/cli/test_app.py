"""The one error handler: bad input exit 2, machine faults exit 1 named as such, only the rest is called a bug."""

import errno
import json

import pytest

from lorakit.cli.app import report_error
from lorakit.cli.common import emit, use_json
from lorakit.errors import ConfigError, EnvironmentFault, InputError, environment_fault, short


@pytest.mark.parametrize("exc, code, words", [
    (InputError("x.yaml: bad", "fix it"), 2, ["x.yaml: bad"]),
    (ConfigError(["lora.rank: bad", "data.dirs: missing"], source="r.yaml"), 2, ["lora.rank", "data.dirs"]),
    (OSError(errno.ENOSPC, "No space left on device", "/data/out/x.safetensors"), 1,
     ["no space left", "/data/out/x.safetensors"]),
    (PermissionError(errno.EACCES, "Permission denied", "/root/secret"), 1, ["permission denied: /root/secret"]),
    (MemoryError(), 1, ["out of host memory"]),
    (ModuleNotFoundError("No module named 'bitsandbytes'", name="bitsandbytes"), 1, ["bitsandbytes"]),
    (ZeroDivisionError("division by zero"), 1, ["division by zero", "bug in lorakit"]),
])
def test_exit_codes_and_messages(capsys, exc, code, words):
    assert report_error(exc, as_json=False) == code
    err = capsys.readouterr().err
    assert err.startswith("error:") and all(w in err for w in words), err
    assert ("bug in lorakit" in err) == isinstance(exc, ZeroDivisionError)


def test_json_errors_have_no_colour_and_one_object(capsys):
    assert report_error(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x"), as_json=True) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["error"] == "EnvironmentFault" and "/mnt/ro/x" in data["message"]


def test_torch_write_failure_on_a_full_disk_names_the_file(tmp_path, monkeypatch):
    import lorakit.errors as E

    monkeypatch.setattr(E, "free_bytes", lambda p: 8 * 1024)
    f = environment_fault(RuntimeError("[enforce fail] unexpected pos 64640 vs 64532"), tmp_path / "state.pt")
    assert isinstance(f, EnvironmentFault) and "no space left" in f.message and "state.pt" in f.message
    assert environment_fault(RuntimeError("something else"), tmp_path / "x") is None


def test_short_cuts_at_a_word_and_drops_terminal_codes():
    text = "Weights only load failed. \x1b[1mDo those steps only if you trust the source\x1b[0m of the file " * 3
    s = short(text, 60)
    assert "\x1b" not in s and s.endswith("…") and len(s) <= 61 and not s[:-1].endswith(" ")


def test_emit_writes_json_only_when_asked(capsys):
    use_json(True)
    emit(True, {"a": 1})
    emit(False, {"a": 2}, lambda: print("people"))
    assert capsys.readouterr().out == '{\n  "a": 1\n}\npeople\n'


@pytest.mark.parametrize("args, said", [
    (["trian"], "No such command 'trian'. Did you mean 'train'?"),
    (["train", "x.yaml", "--dryrun"], "No such option: --dryrun (Possible options: --dry-run)"),
    (["infer"], "Missing argument 'model'."),
    (["convert", "lora", "--jsn", "x"], "No such option: --jsn (Possible options: --json)"),
])
@pytest.mark.slow
def test_a_usage_mistake_is_bad_input_exit_2_with_where_to_look_not_a_bug(args, said):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "lorakit", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert said in r.stderr and "bug" not in r.stderr + r.stdout
    assert "-h` lists its commands and options" in r.stderr
    j = subprocess.run([sys.executable, "-m", "lorakit", *args, "--json"], capture_output=True, text=True, timeout=120)
    assert j.returncode == 2 and json.loads(j.stdout)["error"] == "InputError"
