import pytest

from lorakit.errors import UnknownNameError
from lorakit.models.registry import family_info, family_names


def test_the_eighteen_families():
    assert family_names() == ["flux", "qwen-image", "qwen-image-edit", "qwen-image-edit-plus", "qwen-image-edit-2511",
                              "qwen-image-2.1", "kandinsky5-t2i", "kandinsky5-t2v", "z-image", "flux2-dev", "flux2-klein",
                              "flux2-dev-edit", "flux2-klein-edit", "flux-kontext", "wan2.1-t2v", "wan2.2-t2v",
                              "wan2.2-i2v", "wan2.2-ti2v-5b"]


def test_variants_are_flags_of_one_adapter():
    mods = {family_info(n).module for n in family_names() if n.startswith("qwen-image-edit") or n == "qwen-image"}
    assert mods == {"qwen_image"}
    assert family_info("qwen-image-2.1").module == "qwen_image21"  # another transformer class: its own module
    assert family_info("qwen-image-edit-plus").variant == "edit-plus"


def test_architecture_is_the_naming_scheme_families_share():
    from lorakit.models.registry import arch_names, arch_of

    assert arch_names() == ["flux", "qwen-image", "qwen-image-2.1", "kandinsky5", "z-image", "flux2", "wan"]
    assert arch_of("qwen-image-edit-plus") == "qwen-image" and arch_of("kandinsky5") == "kandinsky5"
    with pytest.raises(UnknownNameError):
        arch_of("sdxl")


def test_typo_suggests_closest():
    with pytest.raises(UnknownNameError) as ei:
        family_info("qwen-imag")
    assert "did you mean 'qwen-image'?" in ei.value.hint


def test_the_block_kind_counts_are_diffusers_own():
    """`BLOCK_KINDS` (known before diffusers is imported) says what each family's transformer class declares."""
    from lorakit.models.registry import BLOCK_KINDS, FAMILIES
    from lorakit.plan.decide import repeated_block_kinds

    for name, info in FAMILIES.items():
        assert BLOCK_KINDS[info.transformer_class] == len(repeated_block_kinds(name)), name
    assert set(BLOCK_KINDS) == {f.transformer_class for f in FAMILIES.values()}  # none left over
