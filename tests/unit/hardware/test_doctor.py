from lorakit.hardware.attention_cases import AttentionReport, CaseResult
from lorakit.hardware.doctor import checks, summary
from lorakit.hardware.probe import GpuFacts
from lorakit.hardware.profiles import choose
from tests.machines import CPU_ONLY, CU121_ARCHES, DGX_SPARK, H100, machine


def by_name(cs):
    return {c.name: c for c in cs}


def test_cpu_machine_is_ready_with_a_gpu_warning():
    cs = by_name(checks(CPU_ONLY, choose("auto", CPU_ONLY)))
    assert cs["gpu"].status == "warn"
    assert cs["profile"].status == "ok" and "cpu" in cs["profile"].detail
    assert summary(list(cs.values()))["fail"] == 0


def test_gb10_with_old_torch_fails_with_install_hint():
    f = machine(GpuFacts(0, "NVIDIA GB10", (12, 1), 119.7, integrated=True, unified=True), arch="aarch64",
                arches=CU121_ARCHES)
    cs = by_name(checks(f, choose("auto", f)))
    assert cs["gpu0 code"].status == "fail"
    assert "sm_121" in cs["gpu0 code"].hint and "cu130" in cs["gpu0 code"].hint


def test_dgx_spark_is_ready():
    cs = checks(DGX_SPARK, choose("auto", DGX_SPARK))
    d = by_name(cs)
    assert d["gpu0 code"].status == "ok" and "unified" in d["gpu0"].detail
    assert summary(cs)["fail"] == 0


def test_missing_diffusers_fails():
    f = machine(None)
    f.packages["diffusers"] = None
    assert by_name(checks(f))["diffusers"].status == "fail"
    f.packages["diffusers"] = "0.30.0"
    assert "0.42" in by_name(checks(f))["diffusers"].hint


def test_attention_results_show_failing_backend_and_choice():
    rep = AttentionReport(fingerprint={}, results=[
        CaseResult("cudnn", "1024px", False, error="RuntimeError: mha_graph.execute failed"),
        CaseResult("flash", "1024px", True, ms=3.0), CaseResult("math", "1024px+mask", False, error="No kernel")],
        choice={"flux": "flash", "qwen-image": None})
    d = by_name(checks(H100, choose("auto", H100), rep))
    assert d["sdpa cudnn"].status == "warn" and "mha_graph" in d["sdpa cudnn"].detail
    assert d["sdpa flash"].status == "ok"
    assert d["attention choice"].status == "fail" and "qwen-image" in d["attention choice"].hint


def test_installed_but_broken_library_is_a_warning_with_a_hint():
    from lorakit.hardware.libs import LibResult

    libs = {"bitsandbytes": LibResult("bitsandbytes", False, "RuntimeError: no kernels for sm_121"),
            "optimum-quanto": LibResult("optimum-quanto", True, "qfloat8 Linear forward on cuda")}
    d = by_name(checks(DGX_SPARK, choose("auto", DGX_SPARK), libs=libs))
    assert d["bitsandbytes"].status == "warn" and "sm_121" in d["bitsandbytes"].detail
    assert "lorakit[quant]" not in d["bitsandbytes"].hint and d["bitsandbytes"].hint
    assert d["optimum-quanto"].status == "ok" and "qfloat8" in d["optimum-quanto"].detail
    assert by_name(checks(DGX_SPARK))["bitsandbytes"].status == "info"  # not exercised with --quick


def test_library_trials_are_cached_per_machine(monkeypatch):
    from lorakit.hardware import libs

    calls = []

    def fake(name, device, timeout=120, child=None):
        calls.append(name)
        return libs.LibResult(name, True, f"{name} ran")

    monkeypatch.setattr(libs, "run_check", fake)
    first = libs.run_checks(["optimum-quanto", "bitsandbytes"], "cuda", H100)
    assert sorted(calls) == ["bitsandbytes", "optimum-quanto"] and first["bitsandbytes"].ok
    seen = []
    again = libs.run_checks(["optimum-quanto", "bitsandbytes"], "cuda", H100, progress=seen.append)
    assert len(calls) == 2 and again == first and len(seen) == 2  # answered from the cache, still reported
    libs.run_checks(["optimum-quanto", "bitsandbytes"], "cuda", H100, use_cache=False)  # --retest
    assert len(calls) == 4
    other = machine(GpuFacts(0, "NVIDIA H200", (9, 0), 139.8))  # another machine: measured again
    libs.run_checks(["bitsandbytes"], "cuda", other)
    assert len(calls) == 5


def test_doctor_prints_each_check_as_it_completes(monkeypatch):
    """The first line comes before the probe; every check is a line of its own, in order, as it is known."""
    from typer.testing import CliRunner

    from lorakit.cli.app import app
    from lorakit.hardware import libs, probe

    order = []
    real_probe = probe.probe

    def slow_probe(disk, use_cache=False):
        order.append("probe")
        return real_probe(disk)

    def trial(name, device, timeout=120, child=None):
        order.append(f"trial {name}")
        return libs.LibResult(name, True, "fine")

    monkeypatch.setattr(probe, "probe", slow_probe)
    monkeypatch.setattr(libs, "run_check", trial)
    r = CliRunner().invoke(app, ["doctor", "--disk", "/tmp"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "lorakit doctor: probing this machine..."
    names = [ln.split()[1] for ln in lines if ln[:1] in "✓⚠✗·"]
    assert names[:3] == ["python", "platform", "torch"] and "bitsandbytes" in names and names[-1] == "profile"
    trial_line = next(i for i, ln in enumerate(lines) if "bitsandbytes trial: works" in ln)
    assert trial_line < next(i for i, ln in enumerate(lines) if ln.startswith("✓ bitsandbytes"))
    assert lines[-1].startswith("ready: 0 failed") and lines[-1].endswith(" s)")  # with the time it took
    data = CliRunner().invoke(app, ["doctor", "--json", "--disk", "/tmp"]).output
    import json

    assert set(json.loads(data)["timings"]) >= {"probe_s", "libs_s", "total_s"}


def test_hopper_without_flash_attn_4_is_told_what_it_takes():
    rep = AttentionReport(fingerprint={"capability": "9.0", "torch": "2.11.0+cu130", "fa4": None},
                          results=[CaseResult("flash", "1024px", True, ms=3.0)], choice={"flux": "flash"})
    d = by_name(checks(H100, choose("auto", H100), rep))
    assert d["sdpa fa4"].status == "info" and 'lorakit[fa4]' in d["sdpa fa4"].hint
    rep.fingerprint.update(cuda="13.0")  # a CUDA 13 torch: the compiler's CUDA 13 build
    assert 'flash-attn-4[cu13]' in by_name(checks(H100, choose("auto", H100), rep))["sdpa fa4"].hint
    rep.fingerprint.update(fa4="4.0.0b36")
    assert "measured" in by_name(checks(H100, choose("auto", H100), rep))["sdpa fa4"].detail
    rep.fingerprint.update(torch="2.9.1")
    assert "2.10" in by_name(checks(H100, choose("auto", H100), rep))["sdpa fa4"].hint
    for fp in ({"capability": "8.9", "torch": "2.11.0", "fa4": None}, {"capability": "9.0"}):  # Ada; an old report
        rep.fingerprint = fp
        assert "sdpa fa4" not in by_name(checks(H100, choose("auto", H100), rep))
