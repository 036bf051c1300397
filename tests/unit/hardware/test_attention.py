"""The attention choice must hold in forward, backward AND the recompute of checkpointed blocks."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, checkpoint

from lorakit.hardware import attention as att
from lorakit.hardware import attention_cases as acases
from lorakit.hardware import attention_choice as choice
from lorakit.hardware import sdpa
from lorakit.models.facts import AttentionCase


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def block(x):
    return F.scaled_dot_product_attention(x, x, x).relu()


@pytest.fixture(autouse=True)
def _restore_switches():
    prev = sdpa.apply(None)
    yield
    sdpa.restore(prev)


def _backward_ops():
    x = torch.randn(1, 2, 16, 8, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    with OpLog() as log:  # the recompute of `block` runs inside backward
        y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    return log.ops


def test_chosen_backend_is_in_force_during_recompute():
    sdpa.apply("flash")
    assert "_scaled_dot_product_flash_attention_for_cpu" in _backward_ops()
    sdpa.apply("math")
    ops = _backward_ops()
    assert "_scaled_dot_product_flash_attention_for_cpu" not in ops
    assert "bmm" in ops or "matmul" in ops  # math SDPA decomposes into matrix products


def test_a_scoped_choice_alone_breaks_recompute():
    """The failure lorakit avoids: `with sdpa_kernel(...)` around the forward only."""
    sdpa.apply(None)  # PyTorch defaults: flash enabled on CPU
    x = torch.randn(1, 2, 16, 8, requires_grad=True)
    with sdpa_kernel([SDPBackend.MATH]):
        y = checkpoint(block, x, use_reentrant=False)
    with pytest.raises(CheckpointError):
        y.sum().backward()


def test_apply_sets_exactly_one_backend_and_restore_undoes_it():
    prev = sdpa.apply("efficient")
    b = torch.backends.cuda
    assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
            b.math_sdp_enabled()) == (False, True, False, False)
    sdpa.restore(prev)
    assert b.math_sdp_enabled() == prev["math"]


def test_unknown_backend_is_refused():
    from lorakit.errors import UnknownNameError

    with pytest.raises(UnknownNameError):
        sdpa.apply("flashy")
    with pytest.raises(UnknownNameError):
        sdpa.apply("flash+fast")


def test_a_pair_of_backends_enables_both():
    import torch

    prev = sdpa.apply("flash+efficient")
    try:
        b = torch.backends.cuda
        assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled()
        assert not b.cudnn_sdp_enabled() and not b.math_sdp_enabled()
    finally:
        sdpa.restore(prev)


def test_fa4_is_refused_where_it_cannot_run_and_nothing_is_switched():
    from lorakit.config import assemble
    from lorakit.errors import NotAvailableError
    from lorakit.hardware import fa4

    cfg, _ = assemble(None, ["model.family=flux", "memory.attention=fa4"], profile="cpu")
    assert cfg.memory.attention == "fa4"
    if torch.cuda.is_available() and fa4.problem() is None:
        pytest.skip("FlashAttention 4 runs here (measured on the GPU: benchmarks-history.md, 2026-11-23)")
    assert "CUDA" in fa4.problem("cpu")
    b = torch.backends.cuda
    before = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled())
    with pytest.raises(NotAvailableError, match="fa4") as e:
        sdpa.apply("fa4+efficient")
    assert "memory.attention=auto" in (e.value.hint or "")
    assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
            b.math_sdp_enabled()) == before
    assert sdpa.apply("flash")["fa4"] is False  # the previous state records FA4 (off), so restore can undo it
    sdpa.restore({**dict(zip(("flash", "efficient", "cudnn", "math"), before, strict=True)), "fa4": False})


def test_choose_picks_fastest_backend_that_passed_all_relevant_cases():
    R = acases.CaseResult
    ok = {"512px": 2.0, "1024px": 5.0, "512px single": 2.0, "1024px single": 5.0}
    rep = acases.AttentionReport(fingerprint={}, results=[
        # cuDNN: fastest, passes the dual-stream layout but fails FLUX's single-stream one
        R("cudnn", "512px", True, 1.0), R("cudnn", "1024px", True, 2.0), R("cudnn", "512px single", True, 1.0),
        R("cudnn", "1024px single", False, error="AcceleratorError: CUDA error: an illegal memory access"),
        R("cudnn", "512px+mask", True, 1.0), R("cudnn", "1024px+mask", True, 3.0),
        *[R("flash", c, True, ms) for c, ms in ok.items()],
        R("flash", "512px+mask", False, error="No available kernel"),
        R("flash", "1024px+mask", False, error="No available kernel"),
        *[R("efficient", c, True, 3 * ms) for c, ms in ok.items()],
        R("efficient", "512px+mask", True, 3.0), R("efficient", "1024px+mask", True, 9.0),
    ])
    assert choice.choose(rep, "flux") == "flash"  # cuDNN fails one FLUX case
    rep.results += [R("cudnn", "model qwen-image", False, error="RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED"),
                    R("efficient", "model qwen-image", True, 40.0)]
    # passing bare SDPA is not enough: the model must pass; efficient takes masked batches, flash the unmasked
    assert choice.choose(rep, "qwen-image") == "flash+efficient"
    rep.results += [R(b, c, True, ms) for b, ms in (("cudnn", 1.0), ("flash", 2.0)) for c in ("512px d128", "1024px d128")]
    assert choice.choose(rep, "kandinsky5-t2i") == "cudnn"  # its own head size, measured
    assert choice.choose(acases.AttentionReport(fingerprint={}), "flux") is None


def test_fa4_is_chosen_where_it_passed_and_is_faster_and_takes_unmasked_batches_of_masked_families():
    R = acases.CaseResult
    cases = {"512px": 2.0, "1024px": 5.0, "512px single": 2.0, "1024px single": 5.0}
    rep = acases.AttentionReport(fingerprint={}, results=[
        *[R("flash", c, True, ms) for c, ms in cases.items()],
        *[R("efficient", c, True, 3 * ms) for c, ms in cases.items()],
        R("efficient", "512px+mask", True, 3.0), R("efficient", "1024px+mask", True, 9.0),
        *[R(b, c, False, error="No available kernel") for b in ("flash", "fa4") for c in ("512px+mask", "1024px+mask")],
        R("efficient", "model qwen-image", True, 40.0),
    ])
    assert choice.choose(rep, "flux") == "flash"  # fa4 not measured (not installed): PyTorch's flash
    rep.results += [R("fa4", c, True, 0.6 * ms) for c, ms in cases.items()]
    assert choice.choose(rep, "flux") == "fa4"
    assert choice.choose(rep, "qwen-image") == "fa4+efficient"
    rep.results = [r for r in rep.results if not (r.backend == "fa4" and r.case == "1024px")]
    rep.results.append(R("fa4", "1024px", False, error="RuntimeError: kernel failed"))
    assert choice.choose(rep, "flux") == "flash"  # one failed case and it is out, however fast the others
    assert choice.choose(rep, "qwen-image") == "flash+efficient"


def test_a_run_gets_the_kernel_fastest_at_its_own_resolution():
    R = acases.CaseResult
    # the H100's numbers (2026-11-23, benchmarks-history.md): FA4 faster at 4608 tokens, slower at 1536
    ms = {"flash": {"512px": 0.77, "1024px": 3.45}, "fa4": {"512px": 1.26, "1024px": 2.12}}
    rep = acases.AttentionReport(fingerprint={}, results=[
        R(b, f"{c}{layout}", True, t) for b, by in ms.items() for c, t in by.items() for layout in ("", " single")])
    rep.results += [R(b, c, False, error="No available kernel") for b in ms for c in ("512px+mask", "1024px+mask")]
    rep.results += [R("efficient", f"{c}{m}", True, 3 * t) for c, t in ms["flash"].items() for m in ("", "+mask")]
    assert choice.choose(rep, "flux") == "fa4"  # doctor's summary: all sizes together
    assert choice.choose(rep, "flux", resolution=1024) == "fa4"
    assert choice.choose(rep, "flux", resolution=512) == "flash"
    assert choice.choose(rep, "flux", resolution=768) == "fa4"  # a tie goes to the larger size
    assert choice.choose(rep, "qwen-image", resolution=512) == "flash+efficient"
    assert choice.choose(rep, "qwen-image", resolution=1328) == "fa4+efficient"
    # a kernel that fails at one size is out at every size
    rep.results = [r for r in rep.results if (r.backend, r.case) != ("fa4", "512px single")]
    rep.results.append(R("fa4", "512px single", False, error="RuntimeError"))
    assert choice.choose(rep, "flux", resolution=1024) == "flash"


def test_fa4_is_measured_only_where_it_is_installed_and_could_run():
    fp = {"torch": "2.11.0+cu130", "capability": "9.0", "fa4": "4.0.0b36"}
    assert choice.measured_backends(fp) == sdpa.ALL_BACKENDS
    for change in ({"fa4": None}, {"capability": "8.9"}, {"torch": "2.9.1"}, {"capability": None}):
        assert choice.measured_backends({**fp, **change}) == sdpa.BACKENDS, change
    assert choice.measured_backends({**fp, "capability": "10.0"}) == sdpa.ALL_BACKENDS
    from lorakit.hardware.probe import probe

    assert "fa4" in acases.fingerprint("cpu", facts=probe(use_cache=True))  # installing it changes the cache key


def test_a_fa4_case_that_cannot_run_is_a_failed_case_not_a_crash():
    r = acases.run_case("fa4", AttentionCase("tiny", 64, False, head_dim=32, heads=2), "cpu", repeats=1)
    assert not r.ok and "fa4" in r.error
    from lorakit.hardware import fa4

    assert not fa4.active()


def test_every_family_declares_cases_and_a_model_case():
    from lorakit.models.registry import family_names

    names = {c.name for c in acases.all_cases()}
    for fam in family_names():
        cases = acases.family_cases(fam)
        assert cases[-1] == acases.model_case(fam) and cases[-1] in acases.all_model_cases()
        assert set(cases[:-1]) <= names and len(cases) > 1
    assert acases.family_masked("qwen-image") and not acases.family_masked("flux")


CPU_CASES = (AttentionCase("tiny", 64, False, heads=2, head_dim=16),
             AttentionCase("tiny single", 64, False, "single", heads=2, head_dim=16),
             AttentionCase("tiny+mask", 64, True, heads=2, head_dim=16))


@pytest.mark.slow
def test_self_test_runs_and_caches_on_cpu():
    rep = att.self_test("cpu", repeats=1, cases=CPU_CASES)
    assert not rep.cached
    math_rows = [r for r in rep.results if r.backend == "math"]
    assert len(math_rows) == 3 and all(r.ok and r.ms > 0 for r in math_rows)
    assert not any(r.ok for r in rep.results if r.backend == "cudnn")  # no cuDNN attention on the CPU
    again = att.self_test("cpu", repeats=1, cases=CPU_CASES)
    assert again.cached and [r.ok for r in again.results] == [r.ok for r in rep.results]


@pytest.mark.slow
def test_jobs_run_in_a_child_process_and_report_as_they_finish():
    seen = []
    rows = att.run_jobs([("math", "tiny"), ("math", "tiny+mask")], "cpu", 1, CPU_CASES, progress=seen.append)
    assert [(r.case, r.ok) for r in rows] == [("tiny", True), ("tiny+mask", True)] and seen == rows


@pytest.mark.slow
def test_a_hung_case_is_a_failure_within_the_watchdog_and_the_rest_still_run(monkeypatch):
    import time as _time

    slow = (AttentionCase("slow", 64, False, heads=2, head_dim=16),) + CPU_CASES
    # the child's bare case "slow" sleeps like a stuck kernel (its run_case patched in the child process)
    monkeypatch.setattr(att, "CHILD", [sys.executable, "-c", HANGING_CHILD])
    t0 = _time.perf_counter()
    rows = att.run_jobs([("math", "slow"), ("math", "tiny")], "cpu", 1, slow, watchdog=2.0)
    assert _time.perf_counter() - t0 < 25
    assert not rows[0].ok and rows[0].error.startswith("hung: no answer in 2 s")
    assert rows[1].ok and rows[1].case == "tiny"  # a fresh child took the rest


HANGING_CHILD = """
import sys, time
from lorakit.hardware import attention, attention_cases
run = attention.run_case
def hang(backend, case, *args):
    if case.name == "slow":
        time.sleep(30)
    return run(backend, case, *args)
attention.run_case = hang
attention._child_main(sys.argv[1])
"""


_KERNEL_OP = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
              "cudnn": "_scaled_dot_product_cudnn_attention"}


def test_known_bad_stack_excludes_backend_even_when_it_passed(monkeypatch):
    from lorakit.models.base import family_adapter

    # a family's rule (FLUX.1 had one for cuDNN 9.19 on sm_90 until its gradients were laid out: test_sdpa.py)
    monkeypatch.setattr(type(family_adapter("flux")), "known_bad_attention",
                        (("cudnn", "919", "9.0", "seen failing inside this transformer"),))
    R = acases.CaseResult
    cases = acases.family_cases("flux")
    rep = acases.AttentionReport(fingerprint={"cudnn": 91900, "capability": "9.0"},
                              results=[R("cudnn", c, True, 1.0) for c in cases] +
                                      [R("flash", c, True, 2.0) for c in cases])
    assert choice.choose(rep, "flux") == "flash"
    qcases = acases.family_cases("qwen-image")
    rep.results += [R("cudnn", c, True, 1.0) for c in qcases] + [R("efficient", c, True, 2.0) for c in qcases]
    assert choice.choose(rep, "qwen-image") == "cudnn"  # the rule is scoped to the families that failed
    rep.fingerprint = {"cudnn": 92000, "capability": "9.0"}
    assert choice.choose(rep, "flux") == "cudnn"


@pytest.fixture(scope="module")
def gpu_report(tmp_path_factory):
    import os

    # LORAKIT_GPU_CACHE lets a GPU session reuse the result `lorakit doctor` just measured
    os.environ["LORAKIT_CACHE"] = os.environ.get("LORAKIT_GPU_CACHE") or str(tmp_path_factory.mktemp("attn"))
    return att.self_test("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["flux", "qwen-image"])
def test_gpu_choice_holds_in_forward_backward_and_recompute(family, gpu_report):
    rep = gpu_report
    backend = rep.choice[family]
    assert backend is not None, rep.to_dict()
    model_case = acases.model_case(family)
    # with a pair (flash+efficient), the masked model case ran on the second
    assert [r.ok for r in rep.results if r.backend == backend.split("+")[-1] and r.case == model_case] == [True]
    sdpa.apply(backend)
    masked = acases.family_masked(family)
    backend = backend.split("+")[-1] if masked else backend.split("+")[0]  # the kernel this input gets
    q = torch.randn(1, 24, 1536, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(1, 1, 1, 1536, device="cuda", dtype=torch.bool) if masked else None

    def blk(x):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    with OpLog() as fwd:
        y = checkpoint(blk, q, use_reentrant=False)
    with OpLog() as bwd:
        y.float().sum().backward()
    assert torch.isfinite(q.grad).all()
    if backend in _KERNEL_OP:
        assert _KERNEL_OP[backend] in fwd.ops
        assert _KERNEL_OP[backend] in bwd.ops  # the recompute ran the same kernel
    other = [op for b, op in _KERNEL_OP.items() if b != backend]
    assert not any(op in bwd.ops for op in other)


def test_a_run_keeps_math_only_as_the_last_resort():
    prev = sdpa.apply("flash", fallback=True)
    try:
        b = torch.backends.cuda
        assert (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(),
                b.math_sdp_enabled()) == (True, False, False, True)
    finally:
        sdpa.restore(prev)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_vae_head_the_chosen_kernel_cannot_take_runs_under_a_runs_switches():
    """FLUX's VAE attends with one 512-wide head; flash alone fails it with "Invalid backend" (seen at real
    size on an H100: the end-of-training samples failed)."""
    import torch.nn.functional as F

    q = torch.randn(1, 1, 1024, 512, device="cuda", dtype=torch.bfloat16)
    prev = sdpa.apply("flash", fallback=True)
    try:
        assert F.scaled_dot_product_attention(q, q, q).isfinite().all()
    finally:
        sdpa.restore(prev)


def test_children_started_early_are_the_ones_the_measurement_takes(monkeypatch):
    """`start_early` (a first run, before its config checks) starts the self-test's children only where the run will
    measure: a CUDA device, an NVIDIA driver, nothing measured here yet; `self_test_family` then takes them, or
    stops them where a measurement was cached meanwhile."""
    made, taken, closed = [], [], []
    monkeypatch.setattr(att, "EARLY", {})
    monkeypatch.setattr(att, "prestart", lambda models: made.append(models) or {"models": {m: [] for m in models}})
    monkeypatch.setattr(att.probe_mod, "machine_key", lambda: None)
    assert not att.start_early("flux", "cuda") and not made  # no NVIDIA driver here
    monkeypatch.setattr(att.probe_mod, "machine_key", lambda: {"key": 1})
    monkeypatch.setattr(att.probe_mod, "facts_cached", lambda: False)  # a first run on this machine
    assert not att.start_early("flux", "cpu")
    assert att.start_early("flux", "cuda") and not att.start_early("flux", "cuda")  # once
    assert made == [(acases.model_case("flux"),)]
    monkeypatch.setattr(att, "self_test", lambda device, cases, models, children=None: taken.append(children) or 1)
    monkeypatch.setattr(att, "_cached", lambda fp: None)
    assert att.self_test_family("flux", "cpu") == 1 and taken == [{"models": {"model flux": []}}]
    assert not att.EARLY  # taken once
    monkeypatch.setattr(att.probe_mod, "facts_cached", lambda: True)
    monkeypatch.setattr(att, "cached_family_report", lambda family, device: "measured")
    assert not att.start_early("flux", "cuda")  # measured here before
    att.EARLY["flux"] = {"bare": None}
    monkeypatch.setattr(att, "_cached", lambda fp: "measured")
    monkeypatch.setattr(att, "close_children", closed.append)
    assert att.self_test_family("flux", "cpu") == "measured" and closed == [{"bare": None}]
    att.EARLY["flux"] = {"bare": 1}
    att.drop_early("flux")
    att.drop_early("flux")  # none left: nothing to stop
    assert closed[1:] == [{"bare": 1}, None] and not att.EARLY
