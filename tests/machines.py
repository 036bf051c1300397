"""Facts of the machines our users own, for probe/profile/doctor tests (no hardware needed)."""

from __future__ import annotations

from lorakit.hardware.probe import Facts, GpuFacts

CU130_ARCHES = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU121_ARCHES = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
PACKAGES = {"diffusers": "0.42.1", "transformers": "5.23.0", "peft": "0.21.2", "accelerate": "1.15.0",
            "safetensors": "0.8.0", "fastsafetensors": "0.5.0", "optimum-quanto": "0.2.7",
            "bitsandbytes": "0.50.2"}


def machine(gpu: GpuFacts | None, arch: str = "x86_64", arches=CU130_ARCHES, ram: float = 125.0) -> Facts:
    return Facts(os="Linux", arch=arch, cpu_count=16, ram_gib=ram, disk_free_gib=500.0, python="3.12.3",
                 torch="2.11.0+cu130", torch_cuda="13.0", cudnn="9.19.0", driver="580.159.04",
                 torch_arch_list=list(arches) if gpu else [], gpus=[gpu] if gpu else [],
                 packages=dict(PACKAGES), fastsafetensors_gpu=bool(gpu))


DGX_SPARK = machine(GpuFacts(0, "NVIDIA GB10", (12, 1), 119.7, integrated=True, unified=True), arch="aarch64",
                    ram=119.7)
RTX4090 = machine(GpuFacts(0, "NVIDIA GeForce RTX 4090", (8, 9), 23.6), ram=64)
RTX5090 = machine(GpuFacts(0, "NVIDIA GeForce RTX 5090", (12, 0), 31.4), ram=64)
H100 = machine(GpuFacts(0, "NVIDIA H100 80GB HBM3", (9, 0), 79.2))
H200 = machine(GpuFacts(0, "NVIDIA H200", (9, 0), 139.8))
RTX3060_12GB = machine(GpuFacts(0, "NVIDIA GeForce RTX 3060", (8, 6), 11.6), ram=32)
CPU_ONLY = machine(None, ram=24)
