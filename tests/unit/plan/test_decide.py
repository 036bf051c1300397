"""What a run decides on this machine beyond the memory plan: compile, CUDA graphs (the attention backend's
decision is tested with the self-test, tests/unit/hardware/test_attention.py)."""

import pytest

from lorakit.errors import NotAvailableError


def test_a_compile_the_run_cannot_do_is_said_not_dropped():
    """The rtx4090/rtx5090 profiles compile by default; with block swapping the blocks are not compiled, and the run
    says so (under FSDP they compile: tests/unit/train/test_prepare.py)."""
    from lorakit.config import assemble
    from lorakit.plan.decide import compile_decision

    cfg, _ = assemble(None, ["model.family=flux", "memory.blocks_to_swap=4"], profile="rtx4090")
    assert cfg.memory.compile is True
    assert "block swapping" in compile_decision(cfg, "cuda", object(), True)[1]
    assert compile_decision(cfg, "cuda", None, True) == (True, None)
    assert compile_decision(cfg, "cpu", object(), True) == (False, None)  # the CPU never compiles: no news
    cfg, _ = assemble(None, ["model.family=flux", "memory.compile=false"], profile="rtx4090")
    assert compile_decision(cfg, "cuda", object(), True) == (False, None)


def test_cuda_graphs_need_compiled_blocks_that_recompute_inside_their_compiled_code_if_at_all():
    """memory.cuda_graphs replays compiled blocks; without them, or while blocks recompute outside their compiled
    code, the run says why it runs without graphs (the CPU compiles nothing and says nothing)."""
    from lorakit.config import assemble
    from lorakit.plan.decide import graphs_decision

    cfg, _ = assemble(None, ["model.family=flux", "memory.cuda_graphs=true"], profile="datacenter")
    assert graphs_decision(cfg, "cuda", True, 0) == (True, None)
    off, why = graphs_decision(cfg, "cuda", True, 12)
    assert not off and "12 of them recompute outside their compiled code" in why
    assert graphs_decision(cfg, "cuda", True, 12, in_graph=True) == (True, None)  # memory.compiled_recompute
    off, why = graphs_decision(cfg, "cuda:0", True, 0, sharded=True)
    assert not off and "under FSDP" in why
    assert graphs_decision(cfg, "cpu", False, 0) == (False, None)
    assert graphs_decision(cfg, "cuda", False, 0) == (False, None)  # compile asked for; compile_decision says why
    cfg, _ = assemble(None, ["model.family=flux", "memory.cuda_graphs=true", "memory.compile=false"],
                     profile="datacenter")
    off, why = graphs_decision(cfg, "cuda", False, 0)
    assert not off and "memory.compile: true" in why
    cfg, _ = assemble(None, ["model.family=flux", "memory.cuda_graphs=true", "schedule.grad_accum=4"],
                     profile="datacenter")
    off, why = graphs_decision(cfg, "cuda", True, 0)
    assert not off and "schedule.grad_accum=4" in why
    cfg, _ = assemble(None, ["model.family=flux"], profile="datacenter")
    assert graphs_decision(cfg, "cuda", True, 0) == (False, None)
    assert graphs_decision(cfg, "cuda", True, 12, in_graph=True) == (False, None)  # not asked for: off, silently


def test_compiled_recompute_applies_to_compiled_recomputed_blocks_and_says_why_not_elsewhere():
    """memory.compiled_recompute compiles a recomputed block's forward with its checkpoint; where the blocks are
    not compiled, swapped, sharded, compiled by the background worker or none recomputes, a run that set it true
    says why (the CPU compiles nothing and says nothing), the default (auto) takes it where it applies and says
    nothing where not; the step's line says it, or how to turn it on where it was set false."""
    from lorakit.config import assemble
    from lorakit.plan.decide import compiled_recompute_decision as decide
    from lorakit.plan.decide import step_line

    cfg, _ = assemble(None, ["model.family=qwen-image", "memory.compiled_recompute=true"], profile="rtx4090")
    assert decide(cfg, "cuda", True, 60, False) == (True, None)
    alone = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"compile_background": False})})
    assert "compiled blocks, their recompute compiled into the backward;" in step_line(alone, "cuda", "auto", False,
                                                                                       False)
    # CUDA graphs would hold the recompute too: the line says how, and what each new shape costs (13-17 s a
    # recording at Qwen-Image's size, docs/profiles.md)
    assert step_line(alone, "cuda", "auto", True, False).endswith(
        "no CUDA graphs (--set memory.cuda_graphs=true: each bucket shape and text length records its graphs once, "
        "a slow step)")
    for args, said in [((True, 60, True), "background compile"), ((True, 0, False), "no block recomputes"),
                       ((True, 60, False, True), "under FSDP")]:
        on, why = decide(cfg, "cuda:0", *args)
        assert not on and why.startswith("memory.compiled_recompute: the recompute runs outside") and said in why
    assert decide(cfg, "cpu", False, 60, False) == (False, None)
    assert decide(cfg, "cuda", False, 60, False) == (False, None)  # compile asked for: compile_decision says why
    swapped, _ = assemble(None, ["model.family=qwen-image", "memory.compiled_recompute=true",
                                 "memory.blocks_to_swap=8"], profile="rtx4090")
    assert "memory.blocks_to_swap" in decide(swapped, "cuda", True, 60, False)[1]
    off, _ = assemble(None, ["model.family=qwen-image", "memory.compiled_recompute=true", "memory.compile=false"],
                      profile="rtx4090")
    assert "needs memory.compile: true" in decide(off, "cuda", False, 60, False)[1]
    default, _ = assemble(None, ["model.family=qwen-image"], profile="rtx4090")
    assert default.memory.compiled_recompute == "auto"  # the default: on wherever it applies, silent where not
    assert decide(default, "cuda", True, 60, False) == (True, None)
    for args in [(True, 60, True), (True, 0, False), (True, 60, False, True), (False, 60, False)]:
        assert decide(default, "cuda:0", *args) == (False, None)
    plain, _ = assemble(None, ["model.family=qwen-image", "memory.compile_background=false",
                               "memory.compiled_recompute=false"], profile="rtx4090")
    assert decide(plain, "cuda", True, 60, False) == (False, None)
    assert "compiled blocks (recompute compiled with them: --set memory.compiled_recompute=true)" in step_line(
        plain, "cuda", "auto", False, False, recompute_possible=decide(cfg, "cuda", True, 60, False)[0])
    assert "recompute" not in step_line(plain, "cuda", "auto", False, False, recompute_possible=False)
    assert "recompute" not in step_line(default, "cuda", "auto", False, False)  # unresolved auto claims nothing


def test_a_cached_fa4_choice_that_cannot_run_now_gives_way_to_the_next_fastest_with_a_note(monkeypatch):
    """Measured while flash-attn-4 worked, run after it broke (seen on an H100, 2026-11-24: its CuTe DSL library
    off the path): the run used to stop with 'set memory.attention=auto' although it was auto."""
    from lorakit.config import assemble
    from lorakit.hardware import fa4
    from lorakit.hardware.attention_cases import AttentionReport, CaseResult
    from lorakit.plan import decide
    from lorakit.plan.resolve import Resolved, plan_run

    R = CaseResult
    cases = {"512px": 2.0, "1024px": 5.0, "512px single": 2.0, "1024px single": 5.0}
    rep = AttentionReport(fingerprint={}, results=[
        *[R("flash", c, True, ms) for c, ms in cases.items()], *[R("fa4", c, True, 0.6 * ms) for c, ms in cases.items()],
        *[R("efficient", c, True, 3 * ms) for c, ms in cases.items()]])
    notes = []
    monkeypatch.setattr(decide, "self_test_family", lambda family, device: rep)
    monkeypatch.setattr(fa4, "problem", lambda device="cuda": "attention fa4 needs the flash-attn-4 package: gone")
    cfg, _ = assemble(None, ["model.family=flux"], profile="datacenter")
    assert decide.attention_backend(cfg, "cuda", notes.append) == "flash"
    assert "chose fa4 for flux" in notes[0] and "gone" in notes[0] and "this run uses flash" in notes[0]
    r = plan_run(Resolved(cfg, {}, "cuda"), cap_gib=80.0)  # the resolved config holds it: the run puts it in force
    assert r.cfg.memory.attention == "flash" and any("chose fa4" in n for n in r.notes)
    monkeypatch.setattr(fa4, "problem", lambda device="cuda": None)  # where it runs, the measured choice stands
    assert decide.attention_backend(cfg, "cuda", notes.append) == "fa4" and len(notes) == 1
    cfg, _ = assemble(None, ["model.family=flux", "memory.attention=flash"], profile="datacenter")
    assert decide.attention_backend(cfg, "cuda", notes.append) == "flash"  # an explicit setting is taken as it is


def test_a_measurement_inside_the_checks_says_how_long_it_took_and_a_cached_one_does_not(monkeypatch):
    """A small card's first run measures its attention inside its checks (no room beside the loading): the checks'
    line says how long of them it took, once per machine; a report from the cache says nothing of it."""
    from lorakit.config import assemble
    from lorakit.hardware.attention_cases import AttentionReport, CaseResult
    from lorakit.plan import decide
    from lorakit.plan.resolve import Resolved, plan_run

    rows = [CaseResult("flash", c, True, 1.0) for c in ("512px", "1024px", "512px single", "1024px single")]
    fresh = AttentionReport(fingerprint={}, results=rows, seconds=12.3)
    monkeypatch.setattr(decide, "self_test_family", lambda family, device: fresh)
    cfg, _ = assemble(None, ["model.family=flux"], profile="datacenter")
    r = plan_run(Resolved(cfg, {}, "cuda"), cap_gib=80.0)  # not deferred: measured in the plan
    assert r.cfg.memory.attention == "flash" and r.attention_measured_s == 12.3
    cached = AttentionReport.from_dict(fresh.to_dict())
    monkeypatch.setattr(decide, "self_test_family", lambda family, device: cached)
    assert plan_run(Resolved(cfg, {}, "cuda"), cap_gib=80.0).attention_measured_s is None


def test_the_background_compile_is_on_only_where_the_card_has_room_to_spare():
    """auto: on where the memory plan saved nothing and the estimate plus the worker's pass leaves the margin;
    off where the plan saves memory (uncompiled blocks hold more), with CUDA graphs, with LoRA dropout; an explicit
    true that cannot run is said."""
    from lorakit.config import assemble
    from lorakit.plan.decide import background_decision

    def cfg(*sets):
        return assemble(None, ["model.family=flux", "lora.dropout=0", *sets], "datacenter")[0]

    room = {"gib": 48.9, "block_gib": 0.42}
    assert background_decision(cfg(), True, False, room, 80.0) == (True, None)
    assert background_decision(cfg(), False, False, room, 80.0) == (False, None)  # nothing compiles
    assert background_decision(cfg(), True, False, {"gib": 78.5, "block_gib": 0.42}, 80.0) == (False, None)
    assert background_decision(cfg("memory.base_quant=fp8"), True, False, room, 80.0) == (False, None)
    assert background_decision(cfg("memory.gradient_checkpointing=true"), True, False, room, 80.0) == (False, None)
    assert background_decision(cfg(), True, True, room, 80.0) == (False, None)  # CUDA graphs
    assert background_decision(cfg("lora.dropout=0.1"), True, False, room, 80.0) == (False, None)
    on, why = background_decision(cfg("memory.compile_background=true"), True, True, room, 80.0)
    assert not on and "CUDA graphs" in why
    assert background_decision(cfg(), True, False, room, 80.0, sharded=True) == (False, None)
    on, why = background_decision(cfg("memory.compile_background=true"), True, False, room, 80.0, sharded=True)
    assert not on and "under FSDP" in why
    assert background_decision(cfg("memory.compile_background=false"), True, False, room, 80.0) == (False, None)


def test_compute_auto_multiplies_in_fp8_over_an_8_bit_base_where_the_gpu_can(monkeypatch):
    """The 24/32 GB profiles ask for `auto`: fp8 products over their 8-bit base on a GPU that runs them; bf16 on
    one that cannot (said, with the reason), on the CPU, over a bf16 base and for a full fine-tune (silently:
    nothing was asked of those); an explicit value is kept."""
    from lorakit.config import assemble
    from lorakit.hardware import fp8
    from lorakit.plan.decide import compute_decision

    monkeypatch.setattr(fp8, "fp8_compute_problem", lambda _d: None)
    for profile in ("rtx4090", "rtx5090"):
        cfg, _ = assemble(None, ["model.family=flux"], profile=profile)
        assert cfg.memory.compute == "auto"
        assert compute_decision(cfg, "cuda:0") == ("fp8", None)
        assert compute_decision(cfg, "cpu") == ("bf16", None)
    for sets in (["memory.base_quant=none"], ["memory.base_quant=nf4"], ["method=full", "memory.base_quant=none"]):
        cfg, _ = assemble(None, ["model.family=flux", *sets], profile="rtx4090")
        assert compute_decision(cfg, "cuda:0") == ("bf16", None)
    cfg, _ = assemble(None, ["model.family=flux"], profile="datacenter")
    assert cfg.memory.compute == "bf16" and compute_decision(cfg, "cuda:0") == ("bf16", None)
    monkeypatch.setattr(fp8, "fp8_compute_problem", lambda _d: "memory.compute=fp8 needs fp8 matrix units (...)")
    cfg, _ = assemble(None, ["model.family=flux"], profile="rtx4090")
    got, why = compute_decision(cfg, "cuda:0")
    assert got == "bf16" and why.startswith("memory.compute auto: bf16 products") and "fp8 matrix units" in why
    cfg, _ = assemble(None, ["model.family=flux", "memory.compute=bf16"], profile="rtx4090")
    assert compute_decision(cfg, "cuda:0") == ("bf16", None)
    cfg, _ = assemble(None, ["model.family=flux", "memory.compute=fp8"], profile="datacenter")
    with pytest.raises(NotAvailableError, match="fp8 matrix units") as ei:  # asked for: refused before loading
        compute_decision(cfg, "cuda:0")
    assert ei.value.hint == "--set memory.compute=bf16"
    monkeypatch.setattr(fp8, "fp8_compute_problem", lambda _d: None)
    assert compute_decision(cfg, "cuda:0") == ("fp8", None) and compute_decision(cfg, "cpu") == ("fp8", None)


def test_the_step_is_said_in_one_line_with_what_was_left_off_and_how_to_turn_it_on(monkeypatch):
    """What the step runs with — compiled blocks, the attention backend and where it came from, bf16 or fp8
    products, CUDA graphs — in one line, and for fp8 and CUDA graphs, where the run left them off and this machine
    could take them, the setting that turns them on; `--dry-run` shows the same line."""
    from lorakit.config import assemble
    from lorakit.plan import resolve as resolve_mod
    from lorakit.plan.decide import step_line

    cfg, _ = assemble(None, ["model.family=flux", "memory.attention=flash", "memory.compile_background=true"],
                      profile="datacenter")
    line = step_line(cfg, "cuda:0", "auto", graphs_possible=True, fp8_possible=True)
    assert line == ("compiled blocks, compiling beside the first steps; attention flash (this machine's fastest); "
                    "bf16 products (fp8: --set memory.compute=fp8); "
                    "no CUDA graphs (--set memory.cuda_graphs=true: compiled at step 1, not beside it)")
    assert "attention flash (as set)" in step_line(cfg, "cuda:0", "flash", False, False)
    auto, _ = assemble(None, ["model.family=flux"], profile="datacenter")  # measured as the run starts, then put in
    assert "measured as the run starts" in step_line(auto, "cuda:0", "auto", False, False, deferred=True)
    assert "attention flash (this machine's fastest)" in step_line(cfg, "cuda:0", "auto", False, False, deferred=True)
    line = step_line(cfg, "cuda:0", "flash", graphs_possible=False, fp8_possible=False)
    assert line.endswith("bf16 products; no CUDA graphs")
    cfg, _ = assemble(None, ["model.family=flux", "memory.compute=fp8", "memory.cuda_graphs=true",
                             "memory.compile_background=false"], profile="datacenter")
    assert step_line(cfg, "cuda", "auto", True, True) == \
        "compiled blocks; attention as PyTorch picks it per call; fp8 products; CUDA graphs"
    assert "the CPU" in step_line(cfg, "cpu", "auto", True, True)
    r = resolve_mod.resolve(None, ["model.family=flux"], "cpu", paths=())
    assert r.step == step_line(r.cfg, "cpu", **r.step_inputs) and r.to_dict()["step"] == r.step


def test_the_cpp_wrapper_applies_to_compiled_blocks_without_graphs_where_a_compiler_is_found():
    """memory.cpp_wrapper launches the compiled blocks' kernels from C++: a run that set it true says why where it
    cannot (blocks not compiled, CUDA graphs, no C++ compiler), "auto" leaves out the background compile silently,
    the CPU says nothing; the step's line names it."""
    from lorakit.config import assemble
    from lorakit.plan.decide import cpp_wrapper_decision as decide
    from lorakit.plan.decide import step_line

    cfg, _ = assemble(None, ["model.family=qwen-image", "memory.cpp_wrapper=true"], profile="rtx4090")
    assert decide(cfg, "cuda", True, False, False, compiler="/usr/bin/g++") == (True, None)
    off, why = decide(cfg, "cuda", True, False, False, compiler=None)
    assert not off and "install g++" in why
    off, why = decide(cfg, "cuda", True, True, False, compiler="/usr/bin/g++")
    assert not off and "CUDA graphs" in why
    off, why = decide(cfg, "cuda", False, False, False, compiler="/usr/bin/g++")
    assert not off and "memory.compile: true" in why
    assert decide(cfg, "cuda", True, False, True, compiler="/usr/bin/g++") == (True, None)  # asked: with the worker
    assert decide(cfg, "cpu", False, False, False, compiler="/usr/bin/g++") == (False, None)
    auto, _ = assemble(None, ["model.family=qwen-image", "memory.cpp_wrapper=auto"], profile="rtx4090")
    assert decide(auto, "cuda", True, False, True, compiler="/usr/bin/g++") == (False, None)
    assert decide(auto, "cuda", True, False, False, compiler=None) == (False, None)  # silently
    assert decide(auto, "cuda", True, False, False, compiler="/usr/bin/g++") == (True, None)
    from lorakit.plan.decide import compiled_recompute_decision

    # a recompute compiled under the C++ wrapper must not replay random state: lorakit's cuDNN operators only
    assert compiled_recompute_decision(auto, "cuda", True, 60, False, cpp_attention="cudnn") == (True, None)
    for attention in ("flash", "auto"):
        off, why = compiled_recompute_decision(auto, "cuda", True, 60, False, cpp_attention=attention)
        assert not off and "memory.cpp_wrapper" in why and "--set memory.attention=cudnn" in why
    assert compiled_recompute_decision(auto, "cuda", True, 60, False) == (True, None)  # no C++ wrapper
    on = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"compile": True, "compiled_recompute": False})})
    line = step_line(on, "cuda", "cudnn", False, False, recompute_possible=True)
    assert "kernels launched from C++" in line and "--set memory.compiled_recompute=true" in line
