"""Several processes, one run: the process group, which rank does what, and how gradients meet.

A run is distributed when the launcher set WORLD_SIZE > 1 (`lorakit train --gpus N`, `torchrun`,
`accelerate launch` all do). Every rank computes the same global batch order and the same random draws
(sigmas, noise, caption dropout) and takes its own slice of the items, so a run on N processes sees exactly
what a 1-process run with the same global batch sees. Each rank's loss is its items' share of the global
mean (sum over its items / global item count), and gradients are summed across ranks: the result equals
the 1-process gradient whatever the split, also when a bucket's last batch does not divide evenly.

LoRA training replicates the (small) trainable weights and sums their gradients in one flat all-reduce per
optimizer step (after accumulation, so accumulating costs no extra communication). Full fine-tuning shards
parameters, gradients and optimizer states with FSDP (`fully_shard` on every transformer block).
Only rank 0 writes checkpoints, samples, metrics and logs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from lorakit.errors import EXIT_INTERRUPTED_RESUMABLE


@dataclass
class Dist:
    """This process's place in the run (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """The device of this rank: cuda:<local_rank> when the run is on CUDA."""
        return f"cuda:{self.local_rank}" if self.enabled and device.startswith("cuda") else device

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as td

            td.barrier()

    def close(self) -> None:
        """Leave the process group (its backend's threads end before the interpreter's: a 2-process CPU run left
        without it aborted once at exit, "terminate called without an active exception")."""
        if self.enabled:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()

    def share(self, part: range | list) -> list:
        """This rank's slice of a list (every world-th element from its rank)."""
        return list(part)[self.rank::self.world]

    def sum_grads(self, params) -> None:
        """Sum the gradients of replicated parameters over ranks, in one flat buffer."""
        if not self.enabled:
            return
        import torch
        import torch.distributed as td

        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        td.all_reduce(flat)
        # back in one multi-tensor copy: a copy_ per tensor cost ~15 us of host time each (1,680 for Qwen-Image's
        # 840 LoRA modules), time the GPU waited where the update came after the loss check
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads,
                                                                      strict=True)])

    def summed(self, t):
        """A tensor summed over ranks (in float64, as `total` sums), where it is: on a GPU the sum is queued on the
        device and the host does not wait for it."""
        if not self.enabled:
            return t
        import torch.distributed as td

        t = t.detach().double()
        td.all_reduce(t)
        return t

    def total(self, value: float) -> float:
        """The sum of a number over ranks (the global loss from each rank's share)."""
        return self.totals([value])[0]

    def totals(self, values: list[float]) -> list[float]:
        """Each number summed over ranks, in one exchange."""
        if not self.enabled:
            return list(values)
        import torch
        import torch.distributed as td

        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        td.all_reduce(t)
        return t.tolist()

    def broadcast(self, obj):
        """Rank 0's value of a picklable object, on every rank."""
        if not self.enabled:
            return obj
        import torch.distributed as td

        box = [obj]
        td.broadcast_object_list(box, src=0)
        return box[0]

    def gathered(self, obj) -> list:
        """Every rank's value of a picklable object, in rank order, on every rank (each rank must call it)."""
        if not self.enabled:
            return [obj]
        import torch.distributed as td

        out = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def _comm_device(self) -> str:
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else "cpu"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[07-09,12],gpu20" -> "gpu07"; "node1,node2" -> "node1")."""
    m = re.match(r"\s*([^,[]+)(?:\[([^],-]+))?", nodelist)  # the first name, and its range's first member
    return m.group(1) + (m.group(2) or "")


def from_slurm(env=None) -> dict:
    """torch's process-group variables from SLURM's, where a job step started one lorakit process per task
    (`srun lorakit train ...`) and no launcher (torchrun, accelerate) set them: RANK, WORLD_SIZE, LOCAL_RANK, and
    the first node of the job as MASTER_ADDR (MASTER_PORT: 29500 + the job id mod 1000, unless set). Returns what
    was set (nothing under a launcher, outside SLURM, or for a single task)."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1") or 1) <= 1:
        return {}
    got = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"],
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    if "MASTER_ADDR" not in env:
        got["MASTER_ADDR"] = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                        or "127.0.0.1")
    if "MASTER_PORT" not in env:
        got["MASTER_PORT"] = str(29500 + int(env.get("SLURM_JOB_ID", "0") or 0) % 1000)
    env.update(got)
    return got


def init(device: str) -> Dist:
    """Join the process group the launcher described (env:// — torchrun and accelerate set the same
    variables); a plain 1-process Dist when WORLD_SIZE is 1 or unset."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return Dist()
    import torch
    import torch.distributed as td

    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device.startswith("cuda")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local)
    if not td.is_initialized():
        kw = {"device_id": torch.device("cuda", local)} if cuda else {}
        td.init_process_group(backend, **kw, **_elastic_store(rank, world))
    return Dist(rank=td.get_rank(), world=td.get_world_size(), local_rank=local, backend=backend)


def _elastic_store(rank: int, world: int) -> dict:
    """Under torchrun's agent store, a store whose keys are this attempt's alone. torchrun keeps its store across
    the restarts of `--max-restarts` and torch adds no per-attempt prefix, so a restarted group would read the dead
    processes' addresses and fail to connect; the prefix keeps each attempt apart. ({} elsewhere: env://.)"""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    import datetime

    import torch.distributed as td

    store = td.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                        timeout=datetime.timedelta(minutes=10))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": td.PrefixStore(f"lorakit/attempt_{attempt}", store), "rank": rank, "world_size": world}


RESULT_ENV = "LORAKIT_LAUNCH_RESULT"  # where rank 0 of a run started by `lorakit train --gpus N` leaves its result


def launched_result() -> str | None:
    """The file a worker started by `lorakit train --gpus N` leaves its run's result in (None: not started so)."""
    return os.environ.get(RESULT_ENV) or None


def run_launched(cmd: list[str]) -> int:
    """Run the launcher (`launch_command`) and wait for it; the exit code one process would have given.

    The launcher runs in a session of its own, and SIGINT, SIGTERM and SIGHUP sent to this process go to its
    workers (the ranks) directly: every rank stops after the same step (`train.stop.StopFlag.share`), the
    run saves its checkpoint, and the workers end with 0, so torch's elastic agent ends cleanly rather than
    stopping the ranks itself (SIGTERM, then SIGKILL 30 s later: a large checkpoint still being written would be
    cut). Rank 0 leaves the result in a file (`launched_result`): an interrupted run ends this command with 75, as
    one process does; a signal before any checkpoint, with 130. Without this a SIGTERM to `lorakit train --gpus 2`
    ended this process alone while the ranks trained on to the end (2 gloo ranks on a CPU, 2026-11-27)."""
    import json
    import signal
    import subprocess
    import tempfile
    from pathlib import Path

    import psutil

    with tempfile.TemporaryDirectory(prefix="lorakit-launch-") as tmp:
        result = Path(tmp) / "result.json"
        proc = subprocess.Popen(cmd, env={**os.environ, RESULT_ENV: str(result)}, start_new_session=True)
        asked = []

        def forward(signum, _frame):
            asked.append(signum)
            try:
                ranks = [c.pid for c in psutil.Process(proc.pid).children()]
            except psutil.NoSuchProcess:
                return
            for pid in ranks or [proc.pid]:  # no rank started yet: the agent stops before starting them
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        done = json.loads(result.read_text()) if result.is_file() else None
    if rc == 0 and done and done.get("interrupted"):
        return EXIT_INTERRUPTED_RESUMABLE
    return 130 if rc and asked and done is None else rc


def launch_command(gpus: int, args: list[str]) -> list[str]:
    """The command `lorakit train --gpus N` runs: N local processes through torch's elastic launcher (what
    `accelerate launch --multi_gpu` uses on one machine), each running `lorakit train` with `args`."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
            "-m", "lorakit", "train", *args]
