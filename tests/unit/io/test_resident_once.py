"""A component is resident once while it loads (issue #35, 4): the peak memory of loading one is at most its own size
plus one shard. Measured as the process's anonymous memory (RssAnon: what it allocated; the checkpoint's mapped file
pages are not counted), polled every 2 ms while a child process loads a component written in the hub's layout and
dtype (bf16, sharded; Qwen2.5-VL under its published tensor names, which transformers renames while loading)."""

import json
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import json, sys, threading, time
from lorakit.io.modules import load_component
import torch

def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:"))

peak, done = [anon_kib()], [False]
def poll():
    while not done[0]:
        peak[0] = max(peak[0], anon_kib())
        time.sleep(0.002)
t = threading.Thread(target=poll, daemon=True)
start = anon_kib()
t.start()
m = load_component(sys.argv[1], "cpu", getattr(torch, sys.argv[2]))
done[0] = True
t.join()
size = sum(p.numel() * p.element_size() for p in m.parameters())
print(json.dumps({"growth": (peak[0] - start) * 1024, "size": size, "dtype": str(next(m.parameters()).dtype)}))
"""


def _write(component, folder, shard_bytes: int) -> int:
    """The component in bf16 under the published names, sharded: returns the largest shard's bytes."""
    from lorakit.io import save_sharded
    from lorakit.models.published import hub_names

    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in component.state_dict().items()}
    kind = "diffusers" if type(component).__module__.startswith("diffusers") else "transformers"
    folder.mkdir(parents=True)
    if kind == "diffusers":
        component.save_config(folder)
    else:
        component.config.architectures = [type(component).__name__]
        component.config.save_pretrained(folder)
    files = save_sharded(hub_names(type(component).__name__, sd), folder,
                         base="diffusion_pytorch_model" if kind == "diffusers" else "model", max_shard_bytes=shard_bytes)
    return max(f.stat().st_size for f in files if f.suffix == ".safetensors")


def _load_peak(folder, dtype: str) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(folder), dtype], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_renamed_text_encoder_is_resident_once_while_it_loads(tmp_path):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from lorakit.models.tiny import qwen_tokenizer

    tok = qwen_tokenizer()
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in [("image_token_id", "<|image_pad|>"), (
        "video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>")]}
    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                             "mrope_section": [16, 24, 24]}),
                           vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                                              out_hidden_size=1024, fullatt_block_indexes=[1]),
                           tie_word_embeddings=False, **ids)
    shard = _write(Qwen2_5_VLForConditionalGeneration(cfg), tmp_path / "text_encoder", 100 * 2**20)
    got = _load_peak(tmp_path / "text_encoder", "float32")  # bf16 on disk, fp32 in memory: the cast is per tensor
    assert got["dtype"] == "torch.float32" and got["size"] > 500 * 2**20
    assert got["growth"] <= got["size"] + 2 * shard + 64 * 2**20, got  # held twice before: ~2x the size


@pytest.mark.slow
def test_a_diffusers_component_is_resident_once_and_keeps_its_fp32_modules(tmp_path):
    from diffusers import Kandinsky5Transformer3DModel

    model = Kandinsky5Transformer3DModel(in_visual_dim=16, out_visual_dim=16, in_text_dim=512, in_text_dim2=256,
                                         time_dim=256, patch_size=(1, 2, 2), model_dim=1024, ff_dim=4096,
                                         num_text_blocks=2, num_visual_blocks=8, axes_dims=(32, 48, 48))
    shard = _write(model, tmp_path / "transformer", 100 * 2**20)  # everything bf16 on disk, as the hub stores it
    got = _load_peak(tmp_path / "transformer", "bfloat16")
    assert got["growth"] <= got["size"] + 2 * shard + 64 * 2**20, got
    from lorakit.io.modules import load_component

    m = load_component(tmp_path / "transformer", "cpu", torch.bfloat16)
    kept = {n: p.dtype for n, p in m.named_parameters() if n.startswith(("time_embeddings", "out_layer.modulation"))}
    assert kept and set(kept.values()) == {torch.float32}, kept  # as diffusers loads them (its forward needs it)


def test_a_renamed_component_for_the_gpu_is_read_on_the_host_and_placed_once(tiny, monkeypatch):
    """The defect on the GPU (Qwen-Image under a 24 GiB cap): the renamed text encoder was read onto the GPU, then
    transformers built a second copy that `.to(device)` moved there too. Now the tensors handed to transformers are
    the file's pages on the host, and transformers puts each one on the device as it fills the model."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from lorakit.io.modules import load_component

    seen = {}

    def from_pretrained(path, config=None, state_dict=None, dtype=None, device_map=None, **kw):
        seen.update(devices={t.device.type for t in state_dict.values()}, device_map=device_map, dtype=dtype)
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(Qwen2_5_VLForConditionalGeneration, "from_pretrained", from_pretrained)
    folder = tiny("qwen-image") / "text_encoder"
    from lorakit.io import load

    stored = set(load(folder))
    from lorakit.io.modules import _class_of, _empty_model

    kind, cls, _ = _class_of(folder)
    if stored <= set(_empty_model(kind, cls, folder).state_dict()):
        pytest.skip("this transformers saves the tiny encoder under its own names (no renaming to exercise)")
    load_component(folder, "cuda:0", torch.bfloat16)
    assert seen == {"devices": {"cpu"}, "device_map": {"": torch.device("cuda", 0)}, "dtype": torch.bfloat16}


def test_unified_memory_moves_each_batch_before_reading_the_next(tmp_path, monkeypatch):
    """DGX Spark: the GPU's tensors take the host's memory, so the host copy of what was read is dropped batch by
    batch (a 38 GiB transformer read whole, then moved, held 77 GiB of the 128 GB: the matrix's dgx-spark cell)."""
    import weakref

    from safetensors.torch import save_file

    from lorakit.io import reader

    names = [f"w{i}" for i in range(5)]
    save_file({n: torch.full((256, 1024), float(i), dtype=torch.bfloat16) for i, n in enumerate(names)},
              str(tmp_path / "a.safetensors"))  # 512 KiB each
    save_file({"big": torch.ones(1024, 1024, dtype=torch.bfloat16)}, str(tmp_path / "b.safetensors"))  # 2 MiB
    real, batches, alive = reader._load_cpu, [], []

    def spy(headers, wanted, threads):
        assert not [r for r in alive if r() is not None]  # every earlier batch's host tensors are gone
        got = real(headers, wanted, threads)
        batches.append(sorted(n for v in wanted.values() for n in v))
        alive.extend(weakref.ref(t) for t in got.values())
        return got

    monkeypatch.setattr(reader, "_load_cpu", spy)
    out = reader.load(tmp_path, device="meta", unified_memory=True)
    assert batches == [sorted(names), ["big"]]
    batches.clear()
    headers = [reader.read_header(tmp_path / f) for f in ("a.safetensors", "b.safetensors")]
    out = reader._load_unified(headers, {h.path: list(h.tensors) for h in headers}, "meta", None, batch=1 << 20)
    assert batches == [["w0", "w1"], ["w2", "w3"], ["w4"], ["big"]]  # about 1 MiB at a time; a larger tensor alone
    assert {k: (v.device.type, tuple(v.shape), v.dtype) for k, v in out.items()} == {
        **{n: ("meta", (256, 1024), torch.bfloat16) for n in names}, "big": ("meta", (1024, 1024), torch.bfloat16)}
