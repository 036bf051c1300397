"""What `train.setup` starts before the caching for a run whose step 1 compiles in its own process."""

from lorakit.config import assemble
from lorakit.train import setup as setup_mod


def _cfg(**memory):
    cfg, _ = assemble({"model": {"family": "flux", "path": "/m"}, "data": {"dirs": ["/d"]}, "memory": memory},
                      profile="rtx4090")
    return cfg


def test_a_run_whose_step_one_compiles_here_starts_its_compile_workers_before_the_caching():
    """Step 1 waits for the compile in the run's process where the blocks compile and not beside the first steps
    (the small cards' profiles): on a GPU. Beside the first steps (a compile process of its own), on the CPU, or
    uncompiled: not."""
    assert setup_mod.compiles_at_step_one(_cfg(compile=True, compile_background=False), "cuda")
    assert setup_mod.compiles_at_step_one(_cfg(compile=True, compile_background="auto"), "cuda:0")  # the plan said
    assert not setup_mod.compiles_at_step_one(_cfg(compile=True, compile_background=True), "cuda")
    assert not setup_mod.compiles_at_step_one(_cfg(compile=True, compile_background=False), "cpu")
    assert not setup_mod.compiles_at_step_one(_cfg(compile=False), "cuda")

