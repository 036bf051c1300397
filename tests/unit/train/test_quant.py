import torch

from lorakit.io.modules import load_component
from lorakit.models.base import load_adapter
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
    assert quantize_blocks(m, torch.float32, device="meta") == 2
    for lin in m.blocks[0]:
        assert isinstance(lin, Float8Linear) and lin.weight.is_meta and lin.weight.dtype == torch.float8_e4m3fn
    assert type(m.head) is torch.nn.Linear and not m.head.weight.is_meta  # outside the blocks: untouched
