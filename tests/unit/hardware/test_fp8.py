"""Can this GPU multiply in fp8 as memory.compute=fp8 does (lorakit.hardware.fp8)? Refused with the reason where
the card has no fp8 units or this PyTorch cannot run the products; the products are fp8_linear's."""

import torch

from lorakit.hardware import fp8


def test_fp8_compute_is_refused_where_it_cannot_run(monkeypatch):
    assert fp8.fp8_compute_problem("cpu") is None  # the reference implementation (slow)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA GeForce RTX 3090")
    assert "RTX 3090 is 8.6" in fp8.fp8_compute_problem("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(fp8, "products_of_ones", lambda _d: [32.0, 16.0])
    assert fp8.fp8_compute_problem("cuda:0") is None


def test_fp8_compute_is_refused_where_this_pytorch_cannot_run_its_products(monkeypatch):
    """A GPU with fp8 units whose PyTorch build has no per-row-scaled product (cuBLAS NOT_SUPPORTED on sm_120 in
    PyTorch 2.10) is refused before the model loads, with the error's first line; wrong values are refused too."""
    from lorakit.train.quant import fp8_linear

    assert fp8.products_of_ones(torch.device("cpu")) == [32.0, 16.0]  # the real products, as fp8_linear calls them
    w8 = torch.ones(16, 32).to(torch.float8_e4m3fn)
    x = torch.ones(16, 32, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(x, w8, torch.ones(16), w8.t().contiguous())
    y.backward(torch.ones_like(y))
    assert [float(y.detach().float().mean()), float(x.grad.float().mean())] == [32.0, 16.0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (12, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA GeForce RTX 5090")

    def unsupported(_d):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmulAlgoGetHeuristic(...)`\n"
                           "more lines")

    monkeypatch.setattr(fp8, "products_of_ones", unsupported)
    why = fp8.fp8_compute_problem("cuda:0")
    assert "RTX 5090 (compute capability 12.0)" in why and "CUBLAS_STATUS_NOT_SUPPORTED" in why
    assert "more lines" not in why and torch.__version__ in why
    monkeypatch.setattr(fp8, "products_of_ones", lambda _d: [32.0, 0.0])
    assert "wrong values" in fp8.fp8_compute_problem("cuda:0")
