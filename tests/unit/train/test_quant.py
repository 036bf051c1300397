import pytest
import torch

from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
from lorakit.plan.resolve import resolve
from lorakit.train.quant import Float8Linear, quantize_blocks


def test_fp8_blocks_keep_predictions_close_and_quarter_the_block_bytes(tiny):
    folder = tiny("flux")
    ref, q = load_component(folder / "transformer"), load_component(folder / "transformer")
    n = quantize_blocks(q, torch.float32)
    assert n == sum(1 for name, m in ref.named_modules() if type(m) is torch.nn.Linear and "blocks." in name)
    assert type(q.proj_out) is torch.nn.Linear and type(q.x_embedder) is torch.nn.Linear  # kept precise
    a = load_adapter("flux", folder)
    text = {k: v[None] for k, v in a.encode_prompts(["a red circle"])[0].items()}
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v_ref = a.predict(ref, x, torch.tensor([0.5]), text)
        v_q = a.predict(q, x, torch.tensor([0.5]), text)
    assert float((v_ref - v_q).norm() / v_ref.norm()) < 0.01
    lin = next(m for m in q.modules() if isinstance(m, Float8Linear))
    assert lin.weight.element_size() == 1 and not lin.weight.requires_grad


def test_layers_are_quantized_one_by_one_onto_the_target_device():
    # a base loaded to the CPU reaches the device already in 8 bits (meta stands in for the GPU here)
    import torch

    from lorakit.train.quant import Float8Linear, quantize_blocks

    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))])
    m.head = torch.nn.Linear(8, 2)
    stats = {}
    assert quantize_blocks(m, torch.float32, device="meta", stats=stats) == 2
    assert stats["waited_s"] >= 0  # through the staging worker, whose wait the prepare phase reports
    for lin, (o, i) in zip(m.blocks[0], [(16, 8), (8, 16)], strict=True):  # each layer got its own weight and bias
        assert isinstance(lin, Float8Linear) and lin.weight.is_meta and lin.weight.dtype == torch.float8_e4m3fn
        assert lin.weight.shape == (o, i) and lin.bias.shape == (o,) and lin.scale.shape == (o,)
    assert type(m.head) is torch.nn.Linear and not m.head.weight.is_meta  # outside the blocks: untouched


def test_a_layer_given_its_moved_weights_rounds_them_as_its_own():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    own = Float8Linear(lin, torch.float32)
    moved = Float8Linear(lin, torch.float32, moved=(lin.weight.detach().clone(), lin.bias.detach().clone()))
    for a, b in ((own.weight, moved.weight), (own.scale, moved.scale), (own.bias, moved.bias)):
        assert torch.equal(a.float(), b.float())
    other = Float8Linear(lin, torch.float32, moved=(lin.weight.detach() * 2, None))  # the moved ones are used
    assert other.bias is None and torch.equal(other.scale, own.scale * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounding_a_few_rows_at_a_time_equals_rounding_the_whole_weight(monkeypatch, dtype):
    from lorakit.train import quant

    torch.manual_seed(0)
    w = (torch.randn(37, 24) * torch.logspace(-6, 3, 37)[:, None]).to(dtype)
    w[5] = 0  # a row of zeros keeps its floor scale
    before = w.clone()
    whole = (w.float().abs().amax(dim=1).clamp(min=1e-12) / quant.E4M3_MAX)
    monkeypatch.setattr(quant, "ROUND_VALUES", 24 * 4)  # 4 rows at a time: 10 parts, the last one short
    w8, scale = quant.rounded_rows(w)
    assert w8.dtype == torch.float8_e4m3fn and torch.equal(scale, whole)
    assert torch.equal(w8.view(torch.uint8), (w.float() / whole[:, None]).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(w, before)  # a float32 weight is rounded from, not in place


def _rounded(t, dtype):
    """t rounded per row to an 8-bit float and back (the reference for the fp8 products)."""
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(dtype).max
    return (t / scale).to(dtype).float() * scale


@pytest.mark.parametrize("transposed", [True, False])
def test_fp8_compute_is_the_product_of_the_rounded_operands_and_its_input_gradient_too(transposed):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * torch.linspace(0.01, 3, 48)[:, None])
    q = Float8Linear(lin, torch.float32, compute="fp8", transposed=transposed)
    assert (q.weight_t is not None) == transposed and "weight_t" not in q.state_dict()  # derived, not saved
    x = (torch.randn(3, 5, 64, generator=g) * 4).requires_grad_(True)  # 15 rows: any count, not only 16k
    y = q(x)
    w = q.dequantized().float()
    torch.testing.assert_close(y, _rounded(x.detach(), torch.float8_e4m3fn) @ w.T + lin.bias, rtol=1e-5, atol=1e-4)
    exact = (x @ lin.weight.T + lin.bias).detach()
    assert 1e-3 < float((y.detach() - exact).norm() / exact.norm()) < 0.05  # rounded, and close
    gy = torch.randn(3, 5, 48, generator=g)
    y.backward(gy)
    gs = gy * q.scale  # the weight's row scales, moved onto the gradient's columns
    want = (_rounded(gs, torch.float8_e5m2) if transposed else gs) @ q.weight.float()
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-4)
    assert q.weight.grad is None and not q.weight.requires_grad


def test_fp8_compute_accumulates_fast_in_both_products(monkeypatch):
    """Hopper's fast accumulation is asked for in the forward product and in the input gradient's (measured
    with held-out loss parity, docs/benchmarks-history.md "Performance V")."""
    seen = []
    real = torch._scaled_mm

    def spy(*a, **k):
        seen.append(k.get("use_fast_accum", False))
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    q = Float8Linear(torch.nn.Linear(32, 16), torch.float32, compute="fp8", transposed=True)
    x = torch.randn(4, 32, requires_grad=True)
    q(x).sum().backward()
    assert seen == [True, True]


@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_the_products_run_outside_the_autograd_function(monkeypatch, compute):
    """The 8-bit layer's product runs where autograd is on (an autograd.Function's forward runs with it off): a
    compiled block that recomputes in its backward graph recomputes what runs there, where PyTorch 2.11's compiler
    kept the products of a Function's forward from forward to backward (245.6 MiB a Qwen-Image block, 2026-12-01).
    The gradient stays the Function's, the output is changed in place as a block may, and a layer without bias
    gives it no view to refuse that on."""
    seen = []
    real = torch._scaled_mm if compute == "fp8" else torch.nn.functional.linear

    def spy(*a, **k):
        seen.append(torch.is_grad_enabled())
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", spy) if compute == "fp8" else \
        monkeypatch.setattr(torch.nn.functional, "linear", spy)
    q = Float8Linear(torch.nn.Linear(32, 16, bias=False), torch.float32, compute=compute)
    x = torch.randn(4, 32, requires_grad=True)
    y = q(x)
    assert seen == [True] and y.requires_grad
    y.mul_(2)  # in place, as a block may
    y.sum().backward()
    want = torch.full((4, 16), 2.0) @ q.dequantized().float()
    torch.testing.assert_close(x.grad, want, rtol=0.1 if compute == "fp8" else 1e-5, atol=0.05)


def test_fp8_compute_trains_a_lora_whose_file_loads_in_stock_diffusers(tmp_path, tiny, monkeypatch):
    from lorakit.train import quant
    from lorakit.train.loop import run
    from tests.unit.train.test_loop import losses, make_cfg

    calls = []
    apply = quant._Fp8Matmul.apply
    monkeypatch.setattr(quant._Fp8Matmul, "apply", lambda *a: calls.append(a[4] is not None) or apply(*a))
    cfg = make_cfg(tmp_path, "qwen-image", tiny("qwen-image"), steps=6, memory={"compute": "fp8"},
                   sampling={"enabled": False}, lora={"dropout": 0.0})
    res = run(resolve(cfg))
    curve = losses(res["metrics"])
    assert len(curve) == 6 and all(map(torch.isfinite, map(torch.tensor, curve)))
    assert res["consumer_check"]["diffusers"] == "equal"
    assert calls and all(calls)  # every block Linear multiplied in fp8, the transposed weight kept (bf16 base)


def test_fp8_compute_is_refused_with_a_full_fine_tune_or_a_4_bit_base(tmp_path, tiny):
    from lorakit.errors import ConfigError
    from tests.unit.train.test_loop import make_cfg

    with pytest.raises(ConfigError, match="memory.compute=fp8 multiplies a frozen base"):
        make_cfg(tmp_path, "flux", tiny("flux"), steps=2, method="full", memory={"compute": "fp8"})
    with pytest.raises(ConfigError, match="not nf4"):
        make_cfg(tmp_path, "flux", tiny("flux"), steps=2, memory={"compute": "fp8", "base_quant": "nf4"})


@pytest.mark.slow
def test_a_compiled_block_over_the_8bit_base_gives_eager_outputs_and_lora_gradients():
    """The rtx4090/rtx5090 profiles compile the blocks over Float8Linear (dequantised inside the compiled graph)."""
    import copy

    from peft import LoraConfig, get_peft_model

    g = torch.Generator().manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    for i in (0, 2):
        with torch.no_grad():
            block[i].weight.copy_(torch.randn(block[i].weight.shape, generator=g) * 0.2)
        block[i] = Float8Linear(block[i], torch.float32)
    eager = get_peft_model(block, LoraConfig(r=4, lora_alpha=4, target_modules=["0", "2"]))
    for n, p in eager.named_parameters():
        if "lora_B" in n:  # B is zero at init: give the LoRA something to do
            p.data = torch.randn(p.shape, generator=g) * 0.1
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin)
    x = torch.randn(6, 32, generator=g)
    y0, y1 = eager(x), compiled(x)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    y0.square().mean().backward()
    y1.square().mean().backward()
    trained = [(n, a, b) for (n, a), (_, b) in zip(eager.named_parameters(), twin.named_parameters(), strict=True)
               if a.requires_grad]
    assert len(trained) == 4  # A and B of both layers; the 8-bit weights are frozen
    for n, a, b in trained:
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_a_compiled_block_keeps_no_cast_copy_of_the_8bit_weights_for_backward():
    """Compiled, the backward's cast of the 8-bit weight must not be shared with the forward's and saved: each
    block that does not recompute would keep its weights in the compute dtype (2 bytes/parameter), past the
    memory plan of the 24/32 GB profiles (Qwen-Image under 32 GiB ran out of memory)."""
    g = torch.Generator().manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    for i in (0, 2):
        block[i] = Float8Linear(block[i], torch.bfloat16)
    block.requires_grad_(False)
    compiled = torch.compile(block)
    shapes = {tuple(m.weight.shape) for m in block if isinstance(m, Float8Linear)}
    x = torch.randn(8, 64, generator=g, dtype=torch.bfloat16, requires_grad=True)
    compiled(x).float().square().mean().backward()  # compile outside the hooks
    kept = []

    def pack(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = compiled(x)
    assert kept, "nothing saved: the check would pass vacuously"
    cast = [k for k in kept if k[1] in shapes and k[0] != torch.float8_e4m3fn]
    assert not cast, f"cast weights kept for backward: {cast}"
    y.float().square().mean().backward()


@pytest.mark.gpu
def test_fp8_products_on_the_gpu_keep_their_error_with_fast_accumulation():
    """On fp8 hardware at a FLUX shape (4608 tokens, 3072 -> 12288): the forward product and the input gradient
    are as close to float32 as their 8-bit rounding allows (measured 2.5% / 5.2% on the
    H100), and fast accumulation adds little of its own against the same product accumulated in full precision."""
    from lorakit.hardware.fp8 import fp8_compute_problem
    from lorakit.train.quant import _per_row

    if not torch.cuda.is_available() or fp8_compute_problem("cuda"):
        pytest.skip("needs a GPU with fp8 matrix units")
    g = torch.Generator("cuda").manual_seed(0)
    lin = torch.nn.Linear(3072, 12288, bias=False, device="cuda")
    q = Float8Linear(lin, torch.bfloat16, compute="fp8", transposed=True)
    w = q.dequantized().float()
    x = (torch.randn(4608, 3072, device="cuda", generator=g)
         * torch.exp(torch.randn(4608, 1, device="cuda", generator=g))).bfloat16().requires_grad_(True)
    gy = (torch.randn(4608, 12288, device="cuda", generator=g)
          * torch.exp(torch.randn(4608, 1, device="cuda", generator=g))).bfloat16()
    y = q(x)
    y.backward(gy)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert rel(y, x.detach().float() @ w.T) < 0.04
    assert rel(x.grad, gy.float() @ w) < 0.08
    gs = gy.float() * q.scale
    g8, g_scale = _per_row(gs, torch.float8_e5m2)
    ones = torch.ones(1, 3072, device="cuda")
    full = torch._scaled_mm(g8, q.weight_t.t(), scale_a=g_scale, scale_b=ones, out_dtype=torch.bfloat16)
    assert rel(x.grad, full) < 0.01
    x8, x_scale = _per_row(x.detach(), torch.float8_e4m3fn)
    full = torch._scaled_mm(x8, q.weight.t(), scale_a=x_scale, scale_b=q.scale[None, :], out_dtype=torch.bfloat16)
    assert rel(y, full) < 0.02  # an H200, 2026-11-26: 0.0115 — under half the 8-bit rounding's own 2.5%
