"""Where `lorakit doctor`'s probe spends its time on this machine (seconds per step, one fresh process)."""

import time

t0 = time.perf_counter()
marks = []


def mark(what: str) -> None:
    marks.append((what, round(time.perf_counter() - t0, 3)))


import typer  # noqa: E402,F401

mark("typer")
import torch  # noqa: E402

mark("import torch")
torch.cuda.is_available()
mark("cuda.is_available")
torch.cuda.get_device_properties(0)
mark("device properties")
torch.cuda.mem_get_info(0)
mark("mem_get_info (context)")
from lorakit.hardware.probe import _driver_version, _fastsafetensors_gpu  # noqa: E402

_driver_version()
mark("driver version")
_fastsafetensors_gpu()
mark("fastsafetensors runtime")
from lorakit.hardware.probe import probe  # noqa: E402

probe()
mark("probe() again")
print("probe times:", marks)
