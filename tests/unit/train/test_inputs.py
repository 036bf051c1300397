"""A micro-step's inputs are a pure function of (seed, step, micro-step); drawing them ahead changes nothing,
and the optimizer update queued before the loss is known is skipped on the device when the loss is not finite
(fused AdamW), or ends the run with nothing written (8-bit AdamW)."""

import math
from dataclasses import dataclass

import pytest
import torch

from lorakit.cache.builder import build, cache_dir_for
from lorakit.cache.store import Store
from lorakit.dist import Dist
from lorakit.errors import InputError
from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.plan.resolve import resolve
from lorakit.train.data import CachedData
from lorakit.train.inputs import Ahead, draw
from lorakit.train.loop import run
from lorakit.train.optim import adamw8bit_class
from lorakit.train.trainer import Trainer
from tests.unit.train.test_loop import losses, make_cfg


@pytest.fixture
def trainer(tmp_path, tiny):
    def make(grad_accum=1, dist=None, **over):
        cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=6, sampling={"enabled": False},
                       schedule={"steps": 6, "warmup_steps": 0, "grad_accum": grad_accum}, **over)
        a = load_adapter("flux", tiny("flux"))
        build(cfg, adapter=a)
        st = Store(cache_dir_for(cfg))
        data = CachedData(st, st.read_manifest(), 2, cfg.seed)
        torch.manual_seed(0)
        return Trainer(cfg, a, load_component(tiny("flux") / "transformer"), data, tmp_path / "o", "cpu",
                       torch.float32, dist)
    return make


def same(a, b):
    assert a.key == b.key and a.weight == b.weight and a.n == b.n and a.batch.keys == b.batch.keys
    assert torch.equal(a.sigmas, b.sigmas) and torch.equal(a.noise, b.noise)
    assert torch.equal(a.batch.latents, b.batch.latents)
    assert a.batch.text.keys() == b.batch.text.keys()
    assert all(torch.equal(a.batch.text[k], b.batch.text[k]) for k in a.batch.text)


def test_inputs_depend_only_on_the_step_and_micro_step(trainer):
    tr = trainer(grad_accum=2, data={"caption_dropout": 0.5})
    same(draw(tr, 3, 1), draw(tr, 3, 1))
    assert not torch.equal(draw(tr, 3, 0).noise, draw(tr, 3, 1).noise)
    ahead = Ahead(tr)
    assert ahead.next_key(3, 0) == (3, 1) and ahead.next_key(3, 1) == (4, 0)
    ahead.prepare(4, 0)
    held = ahead.held
    assert ahead.take(4, 0) is held and ahead.held is None  # used once
    ahead.prepare(4, 0)
    same(ahead.take(5, 0), draw(tr, 5, 0))  # a resume moved the step: drawn again for the step asked


def test_a_failed_draw_ahead_raises_in_the_step_that_needs_it(trainer):
    tr = trainer()
    ahead = Ahead(tr)
    real = tr.data.batch_at
    tr.data.batch_at = lambda i: (_ for _ in ()).throw(OSError("cache file gone"))
    ahead.prepare(1, 0)  # nothing raised here, nothing held
    assert ahead.held is None
    with pytest.raises(OSError, match="cache file gone"):
        ahead.take(1, 0)
    tr.data.batch_at = real
    same(ahead.take(1, 0), draw(tr, 1, 0))


def fused(tr):
    tr.state.opt = torch.optim.AdamW(tr.params, lr=5e-3, fused=True)  # what a CUDA run gets (also runs on the CPU)
    tr.state.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
    return tr


def test_update_queued_before_the_loss_check_matches_the_update_after_it(trainer, monkeypatch):
    a, b = fused(trainer(grad_accum=2)), fused(trainer(grad_accum=2))
    assert a.update_before_check
    torch.manual_seed(1)  # LoRA dropout draws from the global generator
    la = [a.train_step() for _ in range(3)]
    monkeypatch.setattr(Trainer, "update_before_check", property(lambda self: False))
    torch.manual_seed(1)
    lb = [b.train_step() for _ in range(3)]
    assert la == lb
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    assert not hasattr(a.opt, "found_inf")  # not left behind for a later step() outside train_step


def test_a_non_finite_loss_stops_the_step_before_any_weight_or_moment_changes(trainer):
    tr = fused(trainer())
    tr.train_step()
    before = [p.detach().clone() for p in tr.params]
    state = {k: v.clone() for k, v in tr.opt.state[tr.params[0]].items()}
    real = tr.loss_on
    tr.loss_on = lambda *a, **k: real(*a, **k) * float("nan")
    with pytest.raises(InputError, match="the loss became nan at step 2"):
        tr.train_step()
    assert all(torch.equal(p, q) for p, q in zip(tr.params, before, strict=True))
    assert all(torch.equal(tr.opt.state[tr.params[0]][k], v) for k, v in state.items())  # step count too
    assert tr.step == 1 and not hasattr(tr.opt, "found_inf")
    tr.loss_on = real
    assert math.isfinite(tr.train_step()) and tr.step == 2


@dataclass
class TwoRanks(Dist):
    """Rank 0 of a data-parallel pair whose other rank has the same gradients and `other` x this rank's loss (the
    collectives of `Dist` as they would come back)."""

    other: float = 1.0
    world: int = 2

    def summed(self, t):
        return t.detach().double() * (1 + self.other)

    def total(self, value):
        return value * (1 + self.other)

    def sum_grads(self, params):
        for p in params:
            p.grad.mul_(2)

    def barrier(self):
        pass


def test_data_parallel_ranks_queue_the_update_before_the_check_and_skip_on_any_ranks_non_finite_loss(trainer,
                                                                                                    monkeypatch):
    a, b = fused(trainer(dist=TwoRanks())), fused(trainer(dist=TwoRanks()))
    assert a.update_before_check  # data parallel: the update goes ahead of the host's wait for the loss
    torch.manual_seed(1)
    la = [a.train_step() for _ in range(2)]
    with monkeypatch.context() as m:
        m.setattr(Trainer, "update_before_check", property(lambda self: False))
        torch.manual_seed(1)
        lb = [b.train_step() for _ in range(2)]
    assert la == lb and all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    # this rank's loss is finite, the other's is not: both skip the update (the sum decides, not each share)
    a.dist.other = float("inf")
    before = [p.detach().clone() for p in a.params]
    with pytest.raises(InputError, match="the loss became inf at step 3"):
        a.train_step()
    assert all(torch.equal(p, q) for p, q in zip(a.params, before, strict=True)) and a.step == 2


class Watched(torch.Tensor):
    """A summed loss that logs when the host reads it (the host's wait for the GPU)."""

    log: list = []

    def __float__(self):
        Watched.log.append("host reads the loss")
        return super().__float__()


@dataclass
class LoggedRanks(TwoRanks):
    def summed(self, t):
        Watched.log.append("loss sum queued")
        return super().summed(t).as_subclass(Watched)

    def sum_grads(self, params):
        Watched.log.append("gradient sum queued")
        super().sum_grads(params)

    def total(self, value):
        raise AssertionError("a data parallel step sums its loss on the device, not from a host number")


def test_data_parallel_ranks_queue_both_sums_before_the_host_waits_whatever_the_optimizer(trainer):
    tr = trainer(dist=LoggedRanks())  # the CPU's AdamW (not fused): it updates after the check, as 8-bit AdamW does
    assert not tr.update_before_check
    tr.opt.register_step_pre_hook(lambda *_: Watched.log.append("update"))
    Watched.log.clear()
    loss = tr.train_step()
    assert Watched.log == ["loss sum queued", "gradient sum queued", "host reads the loss", "update"]
    assert math.isfinite(loss) and tr.step == 1


def eight_bit(tr):
    tr.state.opt = adamw8bit_class()(tr.params, lr=5e-3)  # what the 24/32 GB profiles' runs get (bitsandbytes)
    tr.state.sched = torch.optim.lr_scheduler.LambdaLR(tr.opt, lambda s: 1.0)
    return tr


class Read(torch.Tensor):
    """A loss that logs when the host reads it (the host's wait for the GPU)."""

    def __float__(self):
        Watched.log.append("host reads the loss")
        return super().__float__()


def test_8bit_adamw_is_queued_before_the_host_reads_the_loss_and_updates_as_after_it(trainer, monkeypatch):
    a, b = eight_bit(trainer()), eight_bit(trainer())
    assert a.update_before_check and not a.skips_on_device
    real = a.loss_on
    a.loss_on = lambda *x, **k: real(*x, **k).as_subclass(Read)
    a.opt.register_step_pre_hook(lambda *_: Watched.log.append("update"))
    Watched.log.clear()
    torch.manual_seed(1)  # LoRA dropout draws from the global generator
    la = [a.train_step() for _ in range(3)]
    assert Watched.log == ["update", "host reads the loss"] * 3
    monkeypatch.setattr(Trainer, "update_before_check", property(lambda self: False))
    torch.manual_seed(1)
    lb = [b.train_step() for _ in range(3)]
    assert la == lb and all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    assert not hasattr(a.opt, "found_inf")  # nothing of the fused path's left on bitsandbytes' optimizer


def test_a_non_finite_loss_under_8bit_adamw_ends_the_run_with_the_last_checkpoint_as_it_was(tmp_path, tiny,
                                                                                            monkeypatch):
    """The 8-bit update queued before the loss check has changed the weights when the loss turns out not finite:
    the run stops at that step and writes nothing after it — no checkpoint, LoRA file or step record of it."""
    cfg = make_cfg(tmp_path, "flux", tiny("flux"), steps=8, optim={"name": "adamw8bit", "lr": 5e-3},
                   sampling={"enabled": False}, output={"save_every": 2, "keep_last": 5})
    real = Trainer.loss_on

    def turns_nan(self, *a, **k):
        loss = real(self, *a, **k)
        return loss * float("nan") if self.step == 4 else loss  # the 5th step
    monkeypatch.setattr(Trainer, "loss_on", turns_nan)
    with pytest.raises(InputError, match="the loss became nan at step 5"):
        run(resolve(cfg))
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert not (out / "lora.safetensors").exists()
    assert len(losses(out / "metrics.jsonl")) == 4
    from safetensors.torch import load_file

    kept = load_file(out / "checkpoints" / "step-000004" / "lora.safetensors")
    assert kept and all(torch.isfinite(t).all() for t in kept.values())
