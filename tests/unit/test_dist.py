"""Several processes on the CPU (gloo): the same run as one process with the same global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lorakit.cli.app import app
from lorakit.plan.resolve import resolve
from tests.unit.train.test_loop import losses, make_cfg


def _write(tmp_path, cfg, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path


def _train(path, *extra, gpus=1):
    r = subprocess.run([sys.executable, "-m", "lorakit", "train", str(path), "--json", "--gpus", str(gpus), *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)  # rank 0 alone prints


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen-image"])
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, tiny, family):
    common = {"lora": {"dropout": 0.0}, "data": {"caption_dropout": 0.2}, "sampling": {"enabled": False}}
    one = make_cfg(tmp_path / "one", family, tiny(family), steps=20, schedule={"batch_size": 2}, **common)
    two = make_cfg(tmp_path / "two", family, tiny(family), steps=20, schedule={"batch_size": 1},
                   output={"save_every": 10}, **common)
    from lorakit.plan.resolve import resolve
    from lorakit.train.loop import run

    r1 = run(resolve(one))  # one process: in this one (the 2-process run is the command)
    r2 = _train(_write(tmp_path, two, "two.yaml"), gpus=2)
    assert (r1["processes"], r1["global_batch"]) == (1, 2)
    assert (r2["processes"], r2["global_batch"]) == (2, 2)
    # every rank's peaks reach rank 0's result, in rank order (the summary prints them beside the plan's estimate)
    assert "per_rank" not in r1 and len(r2["per_rank"]) == 2
    assert all(p["peak_rss_gib"] > 0.1 and p["peak_gpu_gib"] is None for p in r2["per_rank"])
    a, b = losses(r1["metrics"]), losses(r2["metrics"])
    assert len(a) == len(b) == 20
    assert a == pytest.approx(b, rel=0, abs=1e-4)  # every step
    assert a[0] != pytest.approx(a[-1], abs=1e-3)  # and it trained
    # rank 0 alone wrote: one metrics row per step, one set of checkpoints
    out = tmp_path / "two" / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["final", "step-000010", "step-000020"]
    # the 2-process checkpoint resumes in 1 process (same global batch: batch_size 2) and continues exactly
    cont = make_cfg(tmp_path / "two", family, tiny(family), steps=20, schedule={"batch_size": 2},
                    output={"save_every": 10}, **common)
    r3 = run(resolve(cont), resume=str(out / "checkpoints" / "step-000010"))
    assert r3["resumed"]["from_world"] == 2 and r3["resumed"]["note"] is None
    assert losses(r3["metrics"]) == pytest.approx(a, rel=0, abs=1e-4)


@pytest.mark.slow
def test_full_fine_tune_shards_with_fsdp_and_resumes_on_another_process_count(tmp_path, tiny):
    from lorakit.io import load
    from lorakit.train.loop import run

    family = "flux"
    kw = {"lora": {"dropout": 0.0}, "optim": {"lr": 1e-3}}
    ref = make_cfg(tmp_path / "ref", family, tiny(family), steps=6, schedule={"batch_size": 2}, method="full", **kw)
    r1 = run(resolve(ref))  # one process: in this one (the 2-process run and its resume are the commands)
    two = make_cfg(tmp_path / "two", family, tiny(family), steps=6, schedule={"batch_size": 1},
                   output={"save_every": 3}, method="full", **kw)
    r2 = _train(_write(tmp_path, two, "two.yaml"), gpus=2)
    assert r2["method"] == "full" and r2["processes"] == 2
    assert losses(r2["metrics"]) == pytest.approx(losses(r1["metrics"]), rel=0, abs=1e-4)
    final = tmp_path / "two" / "out" / "lora-transformer"
    assert (final / "config.json").is_file()
    a, b = load(final), load(tmp_path / "ref" / "out" / "lora-transformer")
    base = load(tiny(family) / "transformer")
    assert a.keys() == b.keys() == base.keys()  # the whole model, plain diffusers names
    # Adam divides by sqrt(v): float-level differences in tiny gradients show up as ~1e-4 in the weights
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 5e-4
    assert max((a[k] - base[k]).abs().max().item() for k in a) > 3e-3  # the weights themselves trained
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel.from_pretrained(final)  # stock diffusers loads the saved folder
    assert sum(p.numel() for p in m.parameters()) == sum(v.numel() for v in base.values())
    # written by 2 processes, resumed by 1: the same losses as the uninterrupted runs
    one = make_cfg(tmp_path / "two", family, tiny(family), steps=6, schedule={"batch_size": 2},
                   output={"save_every": 3}, method="full", **kw)
    r3 = run(resolve(one), resume=str(tmp_path / "two" / "out" / "checkpoints" / "step-000003"))
    assert r3["resumed"]["from_world"] == 2
    assert losses(r3["metrics"]) == pytest.approx(losses(r1["metrics"]), rel=0, abs=1e-4)
    c = load(final)
    assert max((c[k] - b[k]).abs().max().item() for k in c) < 5e-4


def test_a_full_fine_tune_does_not_take_an_8_bit_base(tmp_path, tiny):
    from lorakit.errors import ConfigError

    with pytest.raises(ConfigError, match="method=full"):  # refused by config validation (--dry-run shows it)
        make_cfg(tmp_path, "flux", tiny("flux"), steps=2, method="full", memory={"base_quant": "fp8"})


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_command_on_two_processes(tmp_path, tiny):
    # the documented launch: `accelerate launch --multi_gpu --num_processes 2 -m lorakit train CONFIG`
    # (on a machine without GPUs lorakit joins over gloo)
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=4, lora={"dropout": 0.0})
    path = _write(tmp_path, cfg)
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                        "-m", "lorakit", "train", str(path), "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)  # one result: rank 0's
    assert res["processes"] == 2 and res["steps"] == 4 and res["lora"]
    assert len(losses(res["metrics"])) == 4


@pytest.mark.slow
def test_full_fine_tune_with_8_bit_states_on_fsdp_shards_resumes_on_the_same_gpu_count(tmp_path, tiny):
    family = "flux"
    kw = {"optim": {"name": "adamw8bit", "lr": 1e-3}, "sampling": {"enabled": False}, "method": "full"}
    cfg = make_cfg(tmp_path / "a", family, tiny(family), steps=6, schedule={"batch_size": 1},
                   output={"save_every": 3}, **kw)
    path = _write(tmp_path, cfg)
    full = _train(path, gpus=2)
    ck = tmp_path / "a" / "out" / "checkpoints" / "step-000003"
    assert sorted(p.name for p in ck.glob("optimizer-rank*")) == ["optimizer-rank0-of-2.pt",
                                                                  "optimizer-rank1-of-2.pt"]
    first = losses(full["metrics"])
    again = _train(path, "--resume", str(ck), gpus=2)
    assert losses(again["metrics"]) == pytest.approx(first, rel=0, abs=1e-6)  # exact continuation
    from lorakit.errors import InputError
    from lorakit.train.loop import run

    with pytest.raises(InputError, match=r"8-bit optimizer states of 2 GPU\(s\)") as err:  # one process here
        run(resolve(cfg), resume=str(ck))
    assert "--gpus 2" in err.value.hint and str(ck) in err.value.message  # a message naming the checkpoint


@pytest.mark.slow
def test_full_fine_tune_with_8_bit_states_on_one_process_resumes_exactly(tmp_path, tiny):
    from lorakit.train.loop import run

    kw = {"optim": {"name": "adamw8bit", "lr": 1e-3}, "sampling": {"enabled": False}, "method": "full",
          "output": {"save_every": 2}}
    a = run(resolve(make_cfg(tmp_path / "a", "qwen-image", tiny("qwen-image"), steps=4, **kw)))
    part = make_cfg(tmp_path / "b", "qwen-image", tiny("qwen-image"), steps=4, **kw)
    run(resolve(part), stop_at=2)
    b = run(resolve(part), resume="latest")
    assert (tmp_path / "b" / "out" / "checkpoints" / "step-000002" / "optimizer-rank0-of-1.pt").is_file()
    assert losses(b["metrics"]) == pytest.approx(losses(a["metrics"]), rel=0, abs=1e-6)
    assert b["transformer"].endswith("lora-transformer")


def test_slurm_tasks_become_torch_ranks_where_no_launcher_set_them():
    from lorakit.dist import first_host, from_slurm

    assert first_host("gpu[07-09,12],gpu20") == "gpu07" and first_host("node1,node2") == "node1"
    assert first_host("a100-[3,5]") == "a100-3" and first_host("localhost") == "localhost"
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "123456"}
    assert from_slurm(env) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu07",
                               "MASTER_PORT": str(29500 + 456)}
    assert from_slurm({**env, "WORLD_SIZE": "8", "RANK": "0"}) == {}  # torchrun / accelerate set them: kept
    assert from_slurm({**env, "SLURM_NTASKS": "1"}) == {}  # one task: a plain run


@pytest.mark.slow
def test_srun_style_tasks_train_as_one_group(tmp_path, tiny):
    # what `srun --ntasks 2 lorakit train CONFIG` starts: two processes that know only SLURM's variables

    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=3, lora={"dropout": 0.0}, sampling={"enabled": False})
    path = _write(tmp_path, cfg)
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT")}
    base.update(SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID=str(os.getpid()))
    procs = [subprocess.Popen([sys.executable, "-m", "lorakit", "train", str(path), "--json"],
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    res = json.loads(outs[0][0])  # rank 0 alone prints
    assert res["processes"] == 2 and res["steps"] == 3 and len(losses(res["metrics"])) == 3


def _json_docs(text: str) -> list:
    dec, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = dec.raw_decode(text, i)
        docs.append(doc)
    return docs


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_nodes(path, *extra):
    """The documented multi-node launch, both "nodes" on this machine: torchrun --nnodes 2 --node-rank 0|1 with a
    c10d rendezvous. Returns rank 0's printed result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "lorakit-test"]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(r), "-m", "lorakit", "train", str(path), "--json", *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    printed = [json.loads(o[0]) for o in outs if o[0].strip()]  # rank 0's node prints the result
    assert len(printed) == 1
    return printed[0]


@pytest.mark.slow
def test_two_nodes_on_localhost_train_checkpoint_and_resume_as_one_process(tmp_path, tiny):
    # the losses are those of one process with the same global batch, through a checkpoint and a resume across
    # the two nodes, each writing its own shards of the sharded checkpoint. (A LoRA's checkpoint is rank 0's alone,
    # the same file on one node or two: its two-process save and resume is
    # test_two_processes_match_one_with_the_same_global_batch.)
    from lorakit.train.loop import run

    common = {"lora": {"dropout": 0.0}, "sampling": {"enabled": False}, "method": "full", "optim": {"lr": 1e-3},
              "output": {"save_every": 2}}
    one = make_cfg(tmp_path / "one", "flux", tiny("flux"), steps=4, schedule={"batch_size": 2}, **common)
    two = make_cfg(tmp_path / "two", "flux", tiny("flux"), steps=4, schedule={"batch_size": 1}, **common)
    path = _write(tmp_path, two, "two.yaml")
    first = _two_nodes(path)
    assert first["processes"] == 2 and first["global_batch"] == 2
    r1 = run(resolve(one))
    want = losses(r1["metrics"])
    assert losses(first["metrics"]) == pytest.approx(want, rel=0, abs=1e-4)
    ck = tmp_path / "two" / "out" / "checkpoints" / "step-000002"
    # __<rank>_<file>.distcp: both nodes wrote their own shards
    assert {p.name.split("_")[2] for p in (ck / "dcp").glob("*.distcp")} == {"0", "1"}
    again = _two_nodes(path, "--resume", str(ck))
    assert again["resumed"]["from_world"] == 2 and losses(again["metrics"]) == pytest.approx(want, rel=0, abs=1e-4)


@pytest.mark.slow
def test_an_elastic_restart_continues_from_the_latest_checkpoint_without_losing_or_repeating_a_step(tmp_path, tiny):
    # torchrun --max-restarts 1: one worker is killed (kill -9) after the step-6 checkpoint is complete; the group
    # restarts, `--resume auto` continues from the newest complete checkpoint, and every step is logged once with
    # the loss of an uninterrupted run
    import signal
    import time

    from lorakit.train.loop import run

    common = {"lora": {"dropout": 0.0}, "sampling": {"enabled": False}, "method": "full", "optim": {"lr": 1e-3},
              "output": {"save_every": 3}}
    cfg = make_cfg(tmp_path / "el", "flux", tiny("flux"), steps=12, schedule={"batch_size": 1}, **common)
    path = _write(tmp_path, cfg, "el.yaml")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "lorakit", "train",
                                 str(path), "--json", "--resume", "auto"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = tmp_path / "el" / "out" / "checkpoints" / "step-000006" / "state.pt"
    deadline = time.monotonic() + 300
    while not marker.is_file() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.is_file(), "no step-6 checkpoint appeared"
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2
    os.kill(int(workers[1]), signal.SIGKILL)
    out, err = launcher.communicate(timeout=600)
    docs = _json_docs(out)  # the killed attempt's rank 0 said why it stopped; then the restarted one's result
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]
    res = docs[-1]
    assert res["resumed"] and res["steps"] == 12
    steps = [json.loads(line)["step"] for line in open(res["metrics"])]
    assert steps == list(range(1, 13))  # none lost, none repeated
    ref = run(resolve(make_cfg(tmp_path / "ref", "flux", tiny("flux"), steps=12, schedule={"batch_size": 2},
                               **common)))
    assert losses(res["metrics"]) == pytest.approx(losses(ref["metrics"]), rel=0, abs=1e-4)


@pytest.mark.slow
def test_gathered_full_checkpoints_still_resume_and_sharded_ones_export(tmp_path, tiny):
    # checkpoints written before sharded checkpoints (transformer/ + state.pt) resume in a run that writes sharded
    # ones, exactly; `lorakit convert checkpoint` turns a sharded one into a folder stock diffusers loads
    from diffusers import FluxTransformer2DModel

    from lorakit.io import load
    from lorakit.train.loop import run

    kw = {"lora": {"dropout": 0.0}, "optim": {"lr": 1e-3}, "sampling": {"enabled": False}, "method": "full"}
    a = run(resolve(make_cfg(tmp_path / "a", "flux", tiny("flux"), steps=4, output={"save_every": 2}, **kw)))
    old = make_cfg(tmp_path / "b", "flux", tiny("flux"), steps=4,
                   output={"save_every": 2, "checkpoint_format": "gathered"}, **kw)
    run(resolve(old), stop_at=2)
    ck = tmp_path / "b" / "out" / "checkpoints" / "step-000002"
    assert (ck / "transformer" / "config.json").is_file() and not (ck / "dcp").exists()
    new = make_cfg(tmp_path / "b", "flux", tiny("flux"), steps=4, output={"save_every": 2}, **kw)
    b = run(resolve(new), resume="latest")
    assert losses(b["metrics"]) == pytest.approx(losses(a["metrics"]), rel=0, abs=1e-6)
    later = tmp_path / "b" / "out" / "checkpoints" / "step-000004"
    assert (later / "dcp" / ".metadata").is_file() and (later / "state.pt").is_file()
    cli = CliRunner()  # the command's code in this process
    r = cli.invoke(app, ["convert", "checkpoint", str(later), str(tmp_path / "exported"), "--json"])
    assert r.exit_code == 0, r.output
    got, final = load(tmp_path / "exported"), load(tmp_path / "b" / "out" / "lora-transformer")
    assert got.keys() == final.keys() and all(got[k].equal(final[k]) for k in got)  # the last step is the final
    FluxTransformer2DModel.from_pretrained(tmp_path / "exported")
    bad = cli.invoke(app, ["convert", "checkpoint", str(ck), str(tmp_path / "x")])
    assert bad.exit_code == 2 and "not a sharded checkpoint" in bad.stderr


_LATE_SIGNAL = '''
import os
if os.environ.get("RANK") == "0":  # the workers only (the launcher's agent has no rank)
    import lorakit.train.stop as c
    shared = c.StopFlag.share
    calls = []

    def share(self, dist, *more):
        everyone = shared(self, dist, *more)
        calls.append(1)
        if len(calls) == 3:  # the exchange before step 1, after step 1, after step 2: then the handler runs
            self.requested = True
        return everyone

    c.StopFlag.share = share
'''


@pytest.mark.slow
def test_a_signal_to_one_rank_after_the_exchange_stops_every_rank_after_the_same_step(tmp_path, tiny):
    # rank 0's handler runs right after the ranks exchanged their flags at the end of step 2 (the window a SIGTERM
    # hit in CI, 2026-11-27): a loop testing its own rank's flag ended rank 0 alone, which waited in the sharded
    # checkpoint's barrier while rank 1 waited in step 3's all-gather, forever. Both stop after step 3 now.
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_LATE_SIGNAL)  # every Python process of the run reads it
    cfg = make_cfg(tmp_path / "late", "flux", tiny("flux"), steps=8, schedule={"batch_size": 1}, method="full",
                   sampling={"enabled": False}, output={"save_every": 0})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "lorakit", "train", str(_write(tmp_path, cfg)), "--json", "--gpus",
                          "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:  # the hang: its ranks go with it
        os.killpg(p.pid, 9)
        raise AssertionError("the ranks did not stop together: 240 s and still running") from None
    assert p.returncode == 75, err[-3000:]  # interrupted, resumable
    res = json.loads(out)
    assert res["interrupted"] and res["steps"] == 3 and res["processes"] == 2
    assert [json.loads(line)["step"] for line in open(res["metrics"])] == [1, 2, 3]
    assert Path(res["checkpoint"]).name == "step-000003"  # the checkpoint an interrupted run saves


_RANKS_COMPILE = '''
import os
if os.environ.get("RANK") is not None:  # the ranks (their separate compile processes are told no rank)
    import functools

    import torch

    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # Inductor on 2 CPU cores: minutes
    import lorakit.plan.resolve as resolve_mod
    import lorakit.train.precompile as pre
    from lorakit.train.compile_bg import BackgroundCompile

    resolve_mod.compile_decision = lambda *a: (True, None)  # the CPU compiles nothing otherwise
    made = pre.Rehearsal.build

    def eager(self, cfg, device):  # the real process, rehearsing without compiling (as in test_precompile)
        made(self, cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"compile": False})}), device)

    pre.Rehearsal.build = eager
    # rank 0 has its graphs in the cache when first asked after its worker began, rank 1 when asked the third time
    # (a step later): whatever the machine's load, the two are ready at different steps
    later = 1 if os.environ["RANK"] == "0" else 3
    loads = BackgroundCompile.loads_now

    def settled(self):
        if self.pending and not self.sealed and self._go.is_set() and self.ahead is not None:
            self._asked = getattr(self, "_asked", 0) + 1
            if self._asked >= later:
                self.ahead.wait(120)
                self._thread.join(120)
        return loads.fget(self)

    BackgroundCompile.loads_now = property(settled)
'''


@pytest.mark.slow
def test_each_rank_compiles_in_its_own_process_and_all_switch_to_compiled_blocks_at_one_step(tmp_path, tiny):
    # a first run's blocks compile in a separate process per rank (its launcher's variables left out of it); a rank
    # whose graphs wait in the cache takes them only when every rank's do, so none holds the others up in the next
    # all-reduce (Qwen-Image on 2x H200, 2026-11-29: steps 2-10 took 2.6-37.8 s with each rank compiling alone)
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_RANKS_COMPILE)
    cfg = make_cfg(tmp_path / "run", "flux", tiny("flux"), steps=10, schedule={"batch_size": 1}, lora={"dropout": 0.0},
                   sampling={"enabled": False}, output={"save_every": 0})
    env = {**os.environ, "LORAKIT_PRECOMPILE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile-cache"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "lorakit", "train", str(_write(tmp_path, cfg)), "--json", "--gpus", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-6000:]
    res = json.loads(r.stdout)
    first, second = (x["compiled_from"] for x in res["per_rank"])
    assert first is not None and first == second, res["per_rank"]  # both ranks, the same step, within the run
    assert 2 < first <= 10
