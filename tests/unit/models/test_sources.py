"""A model from where users keep it: a Hugging Face repo id resolved through the hub's own cache (built here
offline, in the hub's layout), and exactly what to download when it is not there."""

import shutil
import subprocess
import sys

import pytest
import yaml

from lorakit.data.demo import make_demo_dataset
from lorakit.models.sources import is_repo_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root, repo, model, ref="main"):
    """A repo in huggingface_hub's cache layout: models--org--name/{refs/<ref>, snapshots/<commit>/...}."""
    store = root / ("models--" + repo.replace("/", "--"))
    shutil.copytree(model, store / "snapshots" / COMMIT)
    (store / "refs").mkdir(parents=True, exist_ok=True)
    (store / "refs" / ref).write_text(COMMIT)
    return store / "snapshots" / COMMIT


def _lorakit(args, env):
    return subprocess.run([sys.executable, "-m", "lorakit", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def test_repo_ids_are_told_from_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("black-forest-labs/FLUX.1-dev") and is_repo_id("Qwen/Qwen-Image@v1.0")
    assert not is_repo_id("./models/flux") and not is_repo_id("/models/flux") and not is_repo_id("flux")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id("org/name")  # a folder of that name is the folder


@pytest.mark.slow
def test_a_repo_id_trains_from_the_hub_cache_offline_and_a_missing_one_names_the_download(tmp_path, tiny):
    import json
    import os

    hub = tmp_path / "hub"
    snap = _hub_cache(hub, "black-forest-labs/FLUX.1-dev", tiny("flux"))
    _hub_cache(hub, "someone/flux-fork", tiny("flux"), ref="v2")
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": "black-forest-labs/FLUX.1-dev"},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 2}, "sampling": {"enabled": False}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    r = _lorakit(["train", str(tmp_path / "run.yaml"), "--json"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert any(f"black-forest-labs/FLUX.1-dev is {snap}" in w for w in res["warnings"])
    assert yaml.safe_load((tmp_path / "out" / "config.resolved.yaml").read_text())["model"]["path"] == str(snap)
    dry = _lorakit(["train", str(tmp_path / "run.yaml"), "--dry-run", "--json", "--force", "--set",
                    "model.path=someone/flux-fork@v2"], env)
    assert dry.returncode == 0 and json.loads(dry.stdout)["config"]["model"]["path"].endswith(COMMIT)
    missing = _lorakit(["train", str(tmp_path / "run.yaml"), "--dry-run", "--set", "model.path=Qwen/Qwen-Image"], env)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"model.path: Qwen/Qwen-Image is no folder here, and as a Hugging Face repo id it is not (completely) in " \
           f"the hub's cache {hub} and downloads are off (HF_HUB_OFFLINE=1)" in " ".join(missing.stderr.split())
    assert "hf download Qwen/Qwen-Image --include 'model_index.json' '*/*' (" in " ".join(missing.stderr.split())
    assert "GiB free in" in missing.stderr and "bug" not in missing.stderr
    inf = _lorakit(["infer", "black-forest-labs/FLUX.1-dev", "-p", "a cat", "--steps", "1", "--width", "64",
                    "--height", "64", "--device", "cpu", "--dtype", "fp32", "-o", str(tmp_path / "img"), "--json"], env)
    assert inf.returncode == 0, inf.stdout + inf.stderr
    assert json.loads(inf.stdout)["model"] == str(snap)


@pytest.mark.slow
def test_unusual_repo_ids_and_partial_snapshots_are_bad_input_naming_the_rule(tmp_path, tiny, monkeypatch):
    """Dots, dashes, length, non-ASCII: huggingface_hub's own rules, exit 2 — and a cached snapshot holding only
    model_index.json is refused by the dry run as by the run, naming what is missing and the download."""
    import os

    from lorakit.errors import InputError
    from lorakit.models.sources import check_repo_id, model_folder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for bad, rule in (("org/na..me", "Cannot have -- or .."), ("org/-name", "alphanumeric"),
                      ("org/" + "x" * 120, "maximum length is 96"), ("org/naïve", "alphanumeric"),
                      ("org--x/name", "Cannot have -- or .."), ("org/name.git", ".git")):
        assert is_repo_id(bad)
        try:
            model_folder(bad, None)
        except InputError as e:
            assert "not a Hugging Face repo id either" in e.message and rule in e.message, (bad, e.message)
        else:
            raise AssertionError(bad)
    assert check_repo_id("black-forest-labs/FLUX.1-dev") == ("black-forest-labs/FLUX.1-dev", "")

    hub = tmp_path / "hub"
    snap = _hub_cache(hub, "someone/partial", tiny("flux"))
    for entry in snap.iterdir():  # an interrupted download: the index and nothing else
        if entry.name != "model_index.json":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux", "path": "someone/partial"},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 1}, "sampling": {"enabled": False}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    for extra in (["--dry-run"], []):
        r = _lorakit(["train", str(tmp_path / "run.yaml"), *extra], env)
        said = r.stdout + r.stderr
        assert r.returncode == 2 and "lacks" in said and "transformer/" in said and "hf download someone/partial" in said, said
        assert "bug" not in said
    r = _lorakit(["train", str(tmp_path / "run.yaml"), "--dry-run", "--set", "model.path=some.one/x..y"], env)
    assert r.returncode == 2 and "not a Hugging Face repo id either" in r.stdout + r.stderr


@pytest.mark.slow
def test_a_folder_of_another_family_is_refused_by_the_dry_run_as_by_the_run(tmp_path, tiny):
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    cfg = {"profile": "cpu", "model": {"family": "flux-kontext", "path": str(tiny("flux"))},
           "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
           "schedule": {"steps": 1}, "sampling": {"enabled": False}, "output": {"dir": str(tmp_path / "out")}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    import os

    r = _lorakit(["train", str(tmp_path / "run.yaml"), "--dry-run"], dict(os.environ))
    said = r.stdout + r.stderr
    assert r.returncode == 2 and "holds a FluxPipeline, not the FluxKontextPipeline" in said
    assert "set model.family: flux" in said
