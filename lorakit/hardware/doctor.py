"""`lorakit doctor` as a library: facts -> checks (ok / warn / fail, each with a fix hint)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lorakit.hardware import bytecode, fa4
from lorakit.hardware.attention_cases import family_cases, known_bad
from lorakit.hardware.probe import Facts, code_support

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | info
    detail: str
    hint: str = ""


def _ver_tuple(v: str | None) -> tuple:
    out = []
    for part in (v or "0").split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def checks(facts: Facts, choice=None, attention=None, libs: dict | None = None) -> list[Check]:
    """Turn probe facts (plus the profile choice, attention self-test and library checks) into checks, in the
    order `lorakit doctor` prints them (it prints each section as soon as its inputs are known).

    Args:
        libs: name -> `libs.LibResult` from running each optional library for real (None: not run).
    """
    out: list[Check] = []
    add = out.append
    if not base_checks(facts, add):
        return out
    quant_checks(facts, add, libs or {})
    if choice is not None:
        profile_check(choice, add)
    if attention is not None:
        attention_checks(attention, add)
    return out


def base_checks(facts: Facts, add) -> bool:
    """Python, platform, torch, packages, GPUs, disk, loaders: what the probe alone says. False: no torch
    (nothing further can be checked)."""
    py = _ver_tuple(facts.python)
    add(Check("python", OK if py >= (3, 10) else FAIL, facts.python,
              "" if py >= (3, 10) else "lorakit needs Python 3.10 or newer"))
    add(Check("platform", INFO, f"{facts.os} {facts.arch}, {facts.cpu_count} cores, {facts.ram_gib:.0f} GiB RAM"))
    if facts.torch is None:
        add(Check("torch", FAIL, "not installed", "pip install torch (see README: GPU install notes)"))
        return False
    add(Check("torch", OK, f"{facts.torch} (CUDA {facts.torch_cuda or 'none'}, cuDNN {facts.cudnn or 'none'})"))
    pk = facts.packages
    for name, minimum in (("diffusers", (0, 42)), ("transformers", (4, 51)), ("peft", (0, 15)),
                          ("accelerate", (1, 0)), ("safetensors", (0, 4))):
        v = pk.get(name)
        if v is None:
            add(Check(name, FAIL, "not installed", f"pip install '{name}>={'.'.join(map(str, minimum))}'"))
        elif _ver_tuple(v) < minimum:
            add(Check(name, FAIL, v, f"lorakit needs {name} >= {'.'.join(map(str, minimum))}: pip install -U {name}"))
        else:
            add(Check(name, OK, v))
    gpu_checks(facts, add)
    add(Check("disk", WARN if (facts.disk_free_gib or 0) < 50 else OK,
              f"{facts.disk_free_gib} GiB free at {facts.disk_path}",
              "" if (facts.disk_free_gib or 0) >= 50 else "a 20 B model plus caches and checkpoints wants 50+ GiB"))
    loader_checks(facts, add)
    return True


def bytecode_check(add) -> None:
    """This Python: the big libraries' bytecode cached, or compiled from source in every process
    (`hardware.bytecode`)."""
    p = bytecode.problem()
    add(Check("bytecode", OK, f"cached ({', '.join(bytecode.PACKAGES)})") if p is None else
        Check("bytecode", WARN, f"{', '.join(p['names'])} compiled from source in every process (no cached bytecode; "
              f"{p['why']}): seconds at each start of lorakit and of its helper processes", p["fix"]))


def profile_check(choice, add) -> None:
    add(Check("profile", WARN if choice.warnings else OK, f"{choice.profile.name}: {choice.reason}",
              "; ".join(choice.warnings)))


def gpu_checks(facts: Facts, add) -> None:
    if not facts.gpus:
        hint = ("this torch has no CUDA support: install a CUDA build (README: GPU install notes)"
                if not facts.torch_cuda else "no GPU visible: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
        add(Check("gpu", WARN, "no CUDA GPU found: the cpu profile runs tiny models only", hint))
        return
    add(Check("driver", OK if facts.driver else WARN, facts.driver or "unknown",
              "" if facts.driver else "could not read the NVIDIA driver version"))
    for g in facts.gpus:
        mem = "unified (shared with the CPU)" if g.unified else "discrete"
        add(Check(f"gpu{g.index}", OK, f"{g.name}, {g.sm}, {g.total_gib:.0f} GiB, {mem}"))
        cs = code_support(facts, g)
        status = {"exact": OK, "compatible": OK, "ptx": WARN, "none": FAIL, "unknown": WARN}[cs["kind"]]
        hint = ""
        if cs["kind"] in ("ptx", "none"):
            hint = (f"GPU {g.sm} but this torch has no matching code: install a build with {g.sm} "
                    f"(e.g. the cu130 wheels: pip install torch --index-url https://download.pytorch.org/whl/cu130)")
        add(Check(f"gpu{g.index} code", status, cs["detail"], hint))
        add(Check(f"gpu{g.index} bf16", OK if g.bf16 else FAIL, "supported" if g.bf16 else "not supported",
                  "" if g.bf16 else "lorakit trains in bf16: this GPU (pre-Ampere) is not supported"))
        add(Check(f"gpu{g.index} fp8", OK if g.fp8 else INFO, "supported (sm_89+)" if g.fp8 else
                  "not supported: fp8 base storage falls back to qfloat8/8-bit"))
    if facts.gpus and not facts.cudnn:
        add(Check("cudnn", WARN, "not found", "cuDNN not found: install the nvidia-cudnn wheel matching torch's CUDA"))


def loader_checks(facts: Facts, add) -> None:
    v = facts.packages.get("fastsafetensors")
    if v is None:
        add(Check("fastsafetensors", WARN, "not installed", "pip install fastsafetensors (faster cold loads)"))
    elif facts.gpus and facts.fastsafetensors_gpu is False:
        add(Check("fastsafetensors", WARN, f"{v}, cannot reach the GPU runtime",
                  "fastsafetensors cannot find libcudart: it loads to the CPU only; lorakit's own loader is used"))
    else:
        where = "GPU runtime found" if facts.fastsafetensors_gpu else "CPU only"
        add(Check("fastsafetensors", OK, f"{v} ({where})"))
    if facts.gpus:
        add(Check("gpudirect storage", OK if facts.gds else INFO, facts.gds_reason or "available",
                  "" if facts.gds else "optional: loads use page-cache reads + pinned copies instead"))


def quant_checks(facts: Facts, add, libs: dict) -> None:
    # name: (why it matters, how much a missing or broken one matters)
    needs = {"optimum-quanto": ("optional: lorakit's fp8/qfloat8 base is its own Float8Linear, not quanto's", INFO),
             "bitsandbytes": ("needed for 8-bit AdamW and nf4 (rtx4090 profile)", WARN)}
    for name, (why, weight) in needs.items():
        v = facts.packages.get(name)
        res = libs.get(name)
        if v is None:
            add(Check(name, weight, "not installed", f"{why}: pip install 'lorakit[quant]'"))
        elif res is None:
            add(Check(name, INFO, f"{v} (installed; not exercised: run doctor without --quick)"))
        elif res.ok:
            add(Check(name, OK, f"{v}: {res.detail}"))
        else:
            add(Check(name, weight, f"{v} is installed but fails here: {res.detail}",
                      f"{why}; reinstall a build for this platform"))
    extras = [n for n in ("flash-attn", "flash_attn_3", "flash-attn-4", "xformers") if facts.packages.get(n)]
    add(Check("extra attention kernels", INFO, ", ".join(f"{n} {facts.packages[n]}" for n in extras) or "none"))


def attention_checks(report, add) -> None:
    by_backend: dict[str, list] = {}
    for r in report.results:
        by_backend.setdefault(r.backend, []).append(r)
    for backend, rs in by_backend.items():
        bad = [r for r in rs if not r.ok]
        if bad:
            add(Check(f"sdpa {backend}", WARN, f"fails at {', '.join(r.case for r in bad)}: {bad[0].error}",
                      "lorakit does not use this backend where it fails"))
        else:
            ms = ", ".join(f"{r.case} {r.ms:.2f} ms" for r in rs)
            add(Check(f"sdpa {backend}", OK, f"forward+backward pass: {ms}"))
        excluded = known_bad(report.fingerprint, backend)
        if excluded:
            add(Check(f"sdpa {backend} rule", WARN, f"excluded on this stack: {excluded}",
                      "lorakit does not train those families with it here; a newer cuDNN may lift this"))
    measured = {r.case for r in report.results}
    unmeasured = [f for f in report.choice if not set(family_cases(f)) & measured]
    none = [f for f, b in report.choice.items() if b is None and f not in unmeasured]
    detail = ", ".join(f"{f}: {b}" for f, b in report.choice.items() if f not in unmeasured)
    add(Check("attention choice", FAIL if none else OK, detail,
              f"no SDPA backend passed forward+backward for {', '.join(none)}" if none else ""))
    if unmeasured:
        add(Check("attention not measured", INFO, ", ".join(unmeasured),
                  "this report predates these families' cases: run `lorakit doctor --retest` on that machine"))
    fa4_hint(report.fingerprint, add)


def fa4_hint(fp: dict, add) -> None:
    """On Hopper / datacenter Blackwell, say whether FlashAttention 4 was measured, and what it takes if not."""
    if "fa4" not in fp or str(fp.get("capability") or "").split(".")[0] not in ("9", "10"):
        return  # not a GPU it runs on, or a report from before lorakit knew it
    if fa4.candidate(fp):
        add(Check("sdpa fa4", INFO, f"flash-attn-4 {fp['fa4']} measured beside PyTorch's kernels (above)"))
    elif not fp.get("fa4"):
        cu13 = str(fp.get("cuda") or "").split(".")[0] == "13"  # its compiler's build must match torch's CUDA
        add(Check("sdpa fa4", INFO, "flash-attn-4 is not installed",
                  ('pip install "flash-attn-4[cu13]>=4.0.0b36"' if cu13 else 'pip install "lorakit[fa4]"')
                  + ": FlashAttention 4, 1.5-1.6x faster attention at 1024² on an H100 (docs/profiles.md); "
                    "doctor then measures it"))
    else:
        add(Check("sdpa fa4", INFO, f"flash-attn-4 {fp['fa4']} is installed but torch {fp.get('torch')} cannot "
                                    "put it under SDPA", "it needs torch 2.10 or newer"))


def summary(checks_: list[Check]) -> dict:
    counts = {s: sum(c.status == s for c in checks_) for s in (OK, WARN, FAIL, INFO)}
    return counts


def to_dicts(checks_: list[Check]) -> list[dict]:
    return [asdict(c) for c in checks_]
