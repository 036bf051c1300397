"""Tiny, random, complete diffusers pipeline folders for every family, built offline.

They have the real architectures (same classes, same folder layout, same tokenizer types) at
toy sizes, so the code that loads and trains real checkpoints is the code the tests exercise. This module
holds the parts (tokenizers trained on a small corpus, tiny text encoders, VAEs, schedulers); each family's
adapter assembles its pipeline from them (`Adapter.build_tiny`).
Everything is deterministic: the same seed gives byte-identical weights and tokenizers.

    from lorakit.models.tiny import tiny_pipeline
    folder = tiny_pipeline("flux")            # built once, cached under ~/.cache/lorakit/tiny
    folder = build_tiny("qwen-image-edit", out_dir, seed=0)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from lorakit import paths
from lorakit.io import shared_tree
from lorakit.models.base import family_adapter
from lorakit.models.registry import family_names
from lorakit.models.tiny_vae import (  # noqa: F401 (the adapters build their tiny pipelines from tiny.*)
    flow_scheduler,
    flux2_vae,
    flux_vae,
    hunyuan_video_vae,
    qwen_image21_vae,
    qwen_vae,
    seeded,
    wan_vae,
)

SPEC_VERSION = "4"  # bump when a builder changes, so cached folders are rebuilt (4: the T5 vocabulary in one order)

# Words the demo captions use, plus the pipelines' prompt templates: the tokenizers are trained
# on this, so demo prompts tokenize into short, meaningful pieces.
_WORDS = (
    "a an the of in on at with and to top bottom left right center middle corner small large big tiny "
    "red green blue yellow orange purple white black gray pink cyan magenta brown "
    "circle square triangle ring cross star stripe stripes dot dots shape shapes background "
    "photo picture image drawing render of flat simple recolor make turn change into become move "
    "upper lower picture edit "
)
_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
_CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>"]


def _corpus() -> list[str]:
    lines = [_WORDS] * 4
    # templates of the pipelines (system prompts), so common English is learned too
    lines += [
        "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial "
        "relationships of the objects and background:",
        "Describe the key features of the input image (color, shape, size, texture, objects, background), "
        "then explain how the user's text instruction should alter or modify the image. Generate a new image "
        "that meets the user's requirements while maintaining consistency with the original input where "
        "appropriate.",
        "You are a prompt engineer. Describe the video in detail. Describe how the camera moves or shakes, "
        "describe the zoom and view angle, whether it follows the objects. Describe the location of the video, "
        "main characters or objects and their action. Name the visual style of the image.",
        "system user assistant Picture 1: 2: 3:",
    ]
    return lines


# --------------------------------------------------------------------------- tokenizers


def byte_bpe(vocab_size: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def clip_tokenizer():
    from transformers import CLIPTokenizerFast

    raw = byte_bpe(400, _CLIP_SPECIALS)
    return CLIPTokenizerFast(tokenizer_object=raw, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                             pad_token="<|endoftext|>", unk_token="<|endoftext|>", model_max_length=77)


def t5_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # the trainer orders pieces of equal score differently in each process, and numbers the characters it adds last
    # in that order (-8.863988, -8.864088, ... given to "x", "q", "v" in one build, "v", "x", "q" in the next), so the
    # ids, the embeddings they pick and every loss differed between two builds: `make demo` gave loss 1.3874 -> 1.1146
    # or 1.3875 -> 1.1110 (2026-12-01, this machine). One vocabulary: scores to 3 digits, pieces of one score by name.
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    pieces = sorted(((p, round(v, 3)) for p, v in vocab[3:]), key=lambda pv: (-pv[1], pv[0]))
    tok.model = models.Unigram([tuple(pv) for pv in vocab[:3]] + pieces, unk_id=2, byte_fallback=False)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                            special_tokens=[("</s>", tok.token_to_id("</s>"))])
    return T5TokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                           extra_ids=0, model_max_length=512)


def qwen_tokenizer():
    from transformers import Qwen2TokenizerFast

    raw = byte_bpe(420, _QWEN_SPECIALS)
    return Qwen2TokenizerFast(tokenizer_object=raw, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                              pad_token="<|endoftext|>", model_max_length=4096)


# Qwen's chat format, as Qwen3's template renders a user turn and the generation prompt (enable_thinking=False adds
# the empty thinking block)
QWEN3_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
              "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def qwen3_tokenizer():
    tok = qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT
    return tok


# Mistral Small 3.1's chat format as FLUX.2-dev's pipeline renders it: a system turn and a user turn, each a list
# of {type: text} parts (no generation prompt)
MISTRAL3_CHAT = ("{{ bos_token }}{% for m in messages %}{% set text = m['content'] | selectattr('type', 'equalto', "
                 "'text') | map(attribute='text') | join('') %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}"
                 "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}"
                 "{{ eos_token }}{% endif %}{% endfor %}")
_MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                     "[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def mistral3_processor():
    """FLUX.2-dev's tokenizer component: a Pixtral processor (image processor + tokenizer + chat template)."""
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    raw = byte_bpe(440, _MISTRAL_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", model_max_length=4096)
    images = PixtralImageProcessor(size={"longest_edge": 64}, patch_size={"height": 16, "width": 16})
    return PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=16, spatial_merge_size=2,
                            chat_template=MISTRAL3_CHAT)


# Qwen3-VL's chat format for a list of typed parts (Qwen-Image-2.1's pipeline renders its system message with it
# to count the prefix it drops)
QWEN3_VL_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen3_vl_processor(tokenizer):
    """Qwen-Image-2.1's processor: Qwen3-VL's (16-pixel patches) with small pixel budgets."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    size = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    images = Qwen2VLImageProcessor(patch_size=16, merge_size=2, size=size)
    videos = Qwen3VLVideoProcessor(patch_size=16, merge_size=2, size=size)
    return Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos,
                            chat_template=QWEN3_VL_CHAT)


def qwen_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    # small pixel budgets keep the vision tower's token count (and CPU time) low
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    video_processor = Qwen2VLVideoProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=video_processor)


# --------------------------------------------------------------------------- text encoders


def clip_text(tokenizer, seed: int, hidden: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel

    seeded(seed)
    cfg = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                         projection_dim=hidden, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModel(cfg).eval()


def t5_text(tokenizer, seed: int, d_model: int = 32, umt5: bool = False):
    """T5's encoder class (FLUX.1's text encoder), tiny; `umt5`: umT5's (Wan's), the same shape."""
    import transformers

    seeded(seed)
    config, model = ("UMT5Config", "UMT5EncoderModel") if umt5 else ("T5Config", "T5EncoderModel")
    cfg = getattr(transformers, config)(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=8, d_ff=2 * d_model, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id)
    return getattr(transformers, model)(cfg).eval()


def _vision_ids(tokenizer) -> dict:
    """The Qwen vision-language configs' special token ids, from the tokenizer."""
    return {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}


def qwen_vl(tokenizer, seed: int, hidden: int = 32):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    seeded(seed)
    ids = _vision_ids(tokenizer)
    heads = 2
    half_head = hidden // heads // 2
    section = [half_head - 2 * (half_head // 3), half_head // 3, half_head // 3]
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=1,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": section},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           out_hidden_size=hidden, fullatt_block_indexes=[1]),
        **ids,
    )
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def qwen3_vl(tokenizer, seed: int, hidden: int = 32):
    """Qwen3-VL (Qwen-Image-2.1's text encoder): interleaved multimodal rotary sections, deepstack vision layers."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    seeded(seed)
    ids = _vision_ids(tokenizer)
    head = 16
    cfg = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=head,
                         max_position_embeddings=4096, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True},
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=hidden,
                           num_position_embeddings=64, deepstack_visual_indexes=[1]),
        tie_word_embeddings=False, **ids)
    return Qwen3VLForConditionalGeneration(cfg).eval()


def qwen3_text(tokenizer, seed: int, hidden: int = 32):
    from transformers import Qwen3Config, Qwen3Model

    seeded(seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2, max_position_embeddings=1024,
                      tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    return Qwen3Model(cfg).eval()


def qwen3_causal(tokenizer, seed: int, layers: int, hidden: int = 16):
    """Qwen3 with its language-model head (FLUX.2 klein's text encoder class): `layers` deep, as the pipeline reads
    hidden states 9, 18 and 27."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    seeded(seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=hidden // 2,
                      max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    return Qwen3ForCausalLM(cfg).eval()


def mistral3(processor, seed: int, layers: int, hidden: int = 16):
    """Mistral Small 3.1's class (Pixtral vision tower + Mistral language model), `layers` deep: FLUX.2-dev reads
    hidden states 10, 20 and 30."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    seeded(seed)
    tok = processor.tokenizer
    cfg = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=64, patch_size=16),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2, tie_word_embeddings=False)
    return Mistral3ForConditionalGeneration(cfg).eval()


# --------------------------------------------------------------------------- pipelines


def build_pipeline(family: str, seed: int = 0):
    """The tiny pipeline object (in memory) for a family: its adapter builds it from the parts above."""
    return family_adapter(family).build_tiny(seed)


def _shard_size(model) -> int:
    """A max_shard_size that splits the transformer into 3 files (so sharded loading is always tested)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(total // 3 + 1, 1024)


def build_tiny(family: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build and save the tiny pipeline folder of a family (diffusers layout, transformer sharded).

    The folder is written to a temporary sibling and renamed, so a crash leaves no half folder.
    """
    import torch

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        pipe = build_pipeline(family, seed)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        tr = tmp / "transformer"
        shutil.rmtree(tr)
        pipe.transformer.save_pretrained(tr, safe_serialization=True, max_shard_size=_shard_size(pipe.transformer))
        (tmp / "lorakit_tiny.json").write_text(json.dumps(
            {"family": family, "seed": seed, "spec_version": SPEC_VERSION}, indent=2))
        shared_tree(tmp)  # as a download would be: readable by others (mkdtemp made it 0700)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cache_root() -> Path:
    """Where built tiny pipelines are kept (<lorakit cache>/tiny)."""
    return paths.cache_root() / "tiny"


def _key(family: str, seed: int) -> str:
    import diffusers
    import transformers

    raw = f"{family}|{seed}|{SPEC_VERSION}|{diffusers.__version__}|{transformers.__version__}"
    return f"{family}-s{seed}-{hashlib.sha256(raw.encode()).hexdigest()[:10]}"


def tiny_pipeline(family: str, seed: int = 0, root: str | os.PathLike | None = None) -> Path:
    """The cached tiny pipeline folder of a family, built on first use."""
    folder = Path(root or cache_root()) / _key(family, seed)
    if not (folder / "model_index.json").is_file():
        from filelock import FileLock

        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):  # several processes (test workers) may ask at once
            if not (folder / "model_index.json").is_file():
                build_tiny(family, folder, seed)
    return folder


__all__ = ["build_pipeline", "build_tiny", "tiny_pipeline", "cache_root", "family_names"]
