"""A run's config is resolved once and completely: `--dry-run` prints the object the run uses and writes to
config.resolved.yaml, path checks run once, and what the machine decides is refused or noted at the dry run."""

import json

import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.data.demo import make_demo_dataset
from lorakit.plan import resolve as resolve_mod

runner = CliRunner()


def _config(tmp_path, tiny, **memory):
    data = make_demo_dataset(tmp_path / "d", "flat", count=2, size=64)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"family": "flux", "path": str(tiny("flux"))},
        "data": {"dirs": [str(data)], "resolution": 64, "bucket_min_side": 32, "bucket_max_side": 128},
        "schedule": {"steps": 2}, "sampling": {"enabled": False}, "memory": memory,
        "output": {"dir": str(tmp_path / "out")}}))
    return path


def test_the_dry_run_prints_the_config_the_run_uses_and_writes(tmp_path, tiny, monkeypatch):
    path = _config(tmp_path, tiny, blocks_to_swap=2)  # meaningless on the CPU: resolved to 0, with a note
    dry = runner.invoke(app, ["train", str(path), "--profile", "cpu", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)
    assert planned["config"]["memory"]["blocks_to_swap"] == 0 and "on the CPU" in planned["notes"][0]
    calls = []
    real = resolve_mod.check_paths
    monkeypatch.setattr(resolve_mod, "check_paths", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    done = runner.invoke(app, ["train", str(path), "--profile", "cpu", "--json"])
    assert done.exit_code == 0, done.output
    assert len(calls) == 1  # every path of the run checked once
    written = yaml.safe_load((tmp_path / "out" / "config.resolved.yaml").read_text())
    assert written == planned["config"]
    assert any("on the CPU" in w for w in json.loads(done.output)["warnings"])  # the note reaches the run too


def test_a_swap_count_past_the_transformer_is_refused_at_the_dry_run(tmp_path, tiny):
    path = _config(tmp_path, tiny)
    r = runner.invoke(app, ["train", str(path), "--profile", "cpu", "--dry-run", "--set", "memory.blocks_to_swap=999"])
    assert r.exit_code == 2
    assert "memory.blocks_to_swap=999: the flux transformer has 3 blocks (swap at most 2)" in r.output


def test_a_gpu_profile_plans_memory_at_the_dry_run(tmp_path, tiny):
    """On this CPU machine the rtx4090 profile's plan still runs against its card: checkpointing as the estimate
    needs it, and the estimate printed beside the config."""
    path = _config(tmp_path, tiny)
    r = runner.invoke(app, ["train", str(path), "--profile", "rtx4090", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["memory_estimate"]["gib"] > 0 and out["device"] == "cpu"
    assert out["config"]["memory"]["compile"] is False  # the CPU compiles nothing
    assert isinstance(out["config"]["memory"]["checkpoint_blocks"], int)  # planned, not "auto"


def test_a_first_runs_attention_children_start_before_its_checks_and_only_where_it_measures(tmp_path, tiny,
                                                                                            monkeypatch):
    """A training run that may measure its attention backends (a GPU profile, memory.attention auto, one process)
    starts the self-test's children as soon as its config is read, before the machine's probe (which imports torch),
    the path checks and the plan (their imports beside them); a CPU run, a named backend, ranks of several processes
    and a dry run start none; a run refused after they started stops them."""
    from lorakit.config import loading

    started, order, dropped, all_dropped = [], [], [], []

    def start(fam, dev):  # as `attention.start_early`: once per family
        if (fam, dev) not in started:
            started.append((fam, dev))
            order.append("children")

    monkeypatch.setattr(resolve_mod, "start_early", start)
    monkeypatch.setattr(resolve_mod, "drop_early", dropped.append)
    monkeypatch.setattr(resolve_mod, "drop_all_early", lambda: all_dropped.append(1))
    real = resolve_mod.check_paths
    monkeypatch.setattr(resolve_mod, "check_paths", lambda *a, **k: (order.append("paths"), real(*a, **k))[1])
    choose = loading.prof.choose
    monkeypatch.setattr(loading.prof, "choose", lambda *a: (order.append("probe"), choose(*a))[1])
    deferred = []
    monkeypatch.setattr(resolve_mod, "plan_run", lambda r, *a: setattr(r, "attention_deferred", bool(deferred)) or r)
    path = _config(tmp_path, tiny)
    deferred.append(True)  # measured while the run starts: the children wait for it
    resolve_mod.resolve(path, [], "rtx4090", defer_attention=True)
    assert started == [("flux", "cuda")] and order == ["children", "probe", "paths"] and not dropped
    deferred.clear()  # the plan measured (no room) or will not: any left are stopped
    resolve_mod.resolve(path, [], "rtx4090", defer_attention=True)
    assert dropped == ["flux"] and not all_dropped
    started.clear()
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace(str(tiny("flux")), str(tmp_path / "gone")))
    try:  # refused at its path check, after the children started
        resolve_mod.resolve(bad, [], "rtx4090", defer_attention=True)
    except Exception as e:  # noqa: BLE001 - the refusal itself is another test's
        assert "gone" in str(e)
    else:
        raise AssertionError("a missing model folder was not refused")
    assert started == [("flux", "cuda")] and all_dropped == [1]
    for profile, sets, kw in (("cpu", [], {"defer_attention": True}), ("rtx4090", [], {}),
                              ("rtx4090", ["memory.attention=flash"], {"defer_attention": True}),
                              ("rtx4090", [], {"defer_attention": True, "world": 2})):
        started.clear()
        resolve_mod.resolve(path, sets, profile, **kw)
        assert not started, (profile, sets, kw)
