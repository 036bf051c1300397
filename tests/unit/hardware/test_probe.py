from lorakit.hardware.probe import Facts, GpuFacts, code_support, probe
from tests.machines import CU121_ARCHES, DGX_SPARK, H100, machine


def test_sm121_runs_sm120_code_from_cu130_wheels():
    cs = code_support(DGX_SPARK, DGX_SPARK.gpu)
    assert cs["kind"] == "compatible"
    assert "sm_120" in cs["detail"] and "sm_121" in cs["detail"]


def test_exact_sass():
    assert code_support(H100, H100.gpu)["kind"] == "exact"


def test_old_torch_on_gb10_has_no_code():
    f = machine(GpuFacts(0, "NVIDIA GB10", (12, 1), 119.7, integrated=True, unified=True), arches=CU121_ARCHES)
    cs = code_support(f, f.gpu)
    assert cs["kind"] == "none" and "up to sm_90" in cs["detail"]


def test_ptx_only():
    f = machine(GpuFacts(0, "future", (13, 0), 200.0), arches=["sm_90", "compute_120"])
    cs = code_support(f, f.gpu)
    assert cs["kind"] == "ptx" and "compute_120" in cs["detail"]


def test_discrete_h100_is_not_unified_and_gb10_is():
    assert H100.gpu.unified is False
    assert DGX_SPARK.gpu.unified is True


def test_capabilities():
    assert H100.gpu.bf16 and H100.gpu.fp8 and H100.gpu.tf32
    assert GpuFacts(0, "T4", (7, 5), 15.0).bf16 is False
    assert GpuFacts(0, "4090", (8, 9), 23.6).fp8 is True
    assert GpuFacts(0, "A100", (8, 0), 79.0).fp8 is False


def test_facts_roundtrip_through_json_dict():
    d = DGX_SPARK.to_dict()
    assert d["gpus"][0]["sm"] == "sm_121" and d["gpus"][0]["code"]["kind"] == "compatible"
    again = Facts.from_dict(d)
    assert again.gpu.capability == (12, 1) and again.gpu.unified and again.arch == "aarch64"


def test_probe_this_machine_reads_facts_without_failing(tmp_path):
    f = probe(tmp_path)
    assert f.python and f.cpu_count >= 1 and f.ram_gib > 0
    assert f.torch is not None
    assert f.disk_free_gib is not None and f.disk_free_gib > 0
    assert "diffusers" in f.packages
