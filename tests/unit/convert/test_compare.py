"""The probe comparison's threads: a LoRA's small products on one thread (on a busy host every product split over
all cores waited for the slowest: the final checkpoint's read-back took 56-69 s on a 4x H200 host beside four
trainings, 2026-11-26), full-size work on
all of them, and the caller's thread count given back whatever happens."""

import pytest
import torch

from lorakit.convert import comfy
from lorakit.convert import verify as V
from lorakit.convert.compare import deltas_equal
from lorakit.convert.patches import LowRank
from tests.loras import trained_like


@pytest.fixture
def three_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not the machine's count, so that "kept" and "one" differ on any machine
    yield 3
    torch.set_num_threads(before)


def _spy(monkeypatch, owner, name):
    """Record torch's thread count at each call of owner.name."""
    seen, real = [], getattr(owner, name)

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen


def _lora(rows=12, cols=10, rank=2, magnitude=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return LowRank(torch.randn(rank, cols, generator=g), torch.randn(rows, rank, generator=g), 4.0, magnitude)


def test_a_lora_is_compared_on_one_thread_and_the_count_given_back(three_threads, monkeypatch):
    seen = _spy(monkeypatch, LowRank, "probe")
    a = {"m1": _lora(), "m2": _lora(seed=1)}
    assert deltas_equal(a, dict(a)) == (True, "equal")
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == three_threads


def test_dora_keeps_every_thread(three_threads, monkeypatch):
    seen = _spy(monkeypatch, LowRank, "probe")
    a = {"m": _lora(magnitude=torch.rand(12) + 0.5)}
    assert deltas_equal(a, dict(a), base={"m": torch.randn(12, 10)})[0]
    assert seen and set(seen) == {three_threads}


def test_the_count_is_given_back_when_the_comparison_fails(three_threads, monkeypatch):
    def broken(self, x, W=None):
        raise RuntimeError("probe failed")

    monkeypatch.setattr(LowRank, "probe", broken)
    with pytest.raises(RuntimeError, match="probe failed"):
        deltas_equal({"m": _lora()}, {"m": _lora()})
    assert torch.get_num_threads() == three_threads


def test_the_check_after_every_save_runs_its_products_on_one_thread(tiny, tmp_path, three_threads, monkeypatch):
    path = trained_like(tiny, "flux", tmp_path / "l.safetensors", targets="attention", rank=4)
    expected = V.diffusers_view(path, "flux")
    ours, comfys = _spy(monkeypatch, LowRank, "probe"), _spy(monkeypatch, comfy, "probe")
    assert V.check_file(path, "flux", expected) == {"diffusers": "equal", "comfyui": "equal"}
    assert ours and comfys and set(ours) | set(comfys) == {1}
    assert torch.get_num_threads() == three_threads
