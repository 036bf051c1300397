"""Do the optional libraries really work on this device? (doctor's functional checks)

Installed is not usable: bitsandbytes may lack kernels for this GPU or platform, optimum-quanto may fail
to build or find its kernels. Each check runs the smallest real use, in a child process (a library that
crashes or hangs while loading its native code cannot take doctor down), and reports works/fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

from lorakit.hardware.children import close
from lorakit.paths import cache_root, write_whole


@dataclass
class LibResult:
    name: str
    ok: bool
    detail: str


def _quanto(device: str) -> str:
    import torch
    from optimum.quanto import freeze, qfloat8, quantize

    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(device)
    quantize(model, weights=qfloat8)
    freeze(model)
    y = model(torch.randn(2, 64, device=device))
    if not torch.isfinite(y).all():
        raise RuntimeError("non-finite output")
    return f"qfloat8 Linear forward on {device}"


def _bnb(device: str) -> str:
    import bitsandbytes as bnb
    import torch

    p = torch.nn.Parameter(torch.randn(64, 64, device=device))
    before = p.detach().clone()
    opt = bnb.optim.AdamW8bit([p], lr=1e-2, min_8bit_size=0)
    p.grad = torch.randn_like(p)
    opt.step()
    if torch.equal(before, p.detach()):
        raise RuntimeError("the step changed nothing")
    kinds = {str(v.dtype) for v in opt.state[p].values() if torch.is_tensor(v)}
    if "torch.uint8" not in kinds:
        raise RuntimeError(f"states are not 8-bit: {sorted(kinds)}")
    return f"AdamW8bit step on {device} with 8-bit states"


CHECKS = {"optimum-quanto": _quanto, "bitsandbytes": _bnb}


def spawn(name: str) -> subprocess.Popen:
    """A child for one library's check, started early (it imports torch and the library, then waits for the
    device on stdin)."""
    return subprocess.Popen([sys.executable, "-c", f"from lorakit.hardware.libs import _child; _child({name!r})"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(children: dict) -> None:
    for p in children.values():
        close(p)


def run_checks(names, device: str, facts=None, use_cache: bool = True, progress=None,
               children: dict | None = None) -> dict:
    """Every named library's check, in parallel children; results are cached per machine and library versions
    (`facts`: the probe's, for the fingerprint), so a second doctor answers at once. `children`: from `spawn`,
    by name (used where they fit, the rest stopped)."""

    names = list(names)
    children = dict(children or {})
    try:
        return _run_checks(names, device, facts, use_cache, progress, children)
    finally:
        _stop(children)


def _run_checks(names, device, facts, use_cache, progress, children) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    path = _cache_file(device, facts, names) if facts is not None else None
    if use_cache and path is not None and path.is_file():
        try:
            out = {n: LibResult(**d) for n, d in json.loads(path.read_text()).items()}
            if set(out) == set(names):
                for r in out.values():
                    if progress:
                        progress(r)
                return out
        except (ValueError, TypeError):
            pass  # a damaged cache is simply re-run
    out = {}
    with ThreadPoolExecutor(max_workers=max(1, len(names))) as ex:
        for r in ex.map(lambda n: run_check(n, device, child=children.pop(n, None)), names):
            out[r.name] = r
            if progress:
                progress(r)
    if path is not None:
        text = json.dumps({n: asdict(r) for n, r in out.items()})
        write_whole(path, lambda tmp: tmp.write_text(text))  # an unwritable cache only costs a re-run
    return out


def _cache_file(device: str, facts, names):
    import hashlib

    key = {"device": device, "names": sorted(names), "python": facts.python, "torch": facts.torch,
           "driver": facts.driver, "gpus": [g.name for g in facts.gpus], "arch": facts.arch,
           "versions": {n: facts.packages.get(n) for n in names}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_root() / "libs" / f"{digest}.json"


def run_check(name: str, device: str, timeout: float = 120, child: subprocess.Popen | None = None) -> LibResult:
    """One library's smallest real use, in a child process (`child`: one from `spawn`)."""
    p = child or spawn(name)
    try:
        out, err = p.communicate(device + "\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return LibResult(name, False, f"hung: no answer in {timeout:.0f} s")
    try:
        return LibResult(**json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        tail = (err.strip().splitlines() or ["no output"])[-1][:200]
        return LibResult(name, False, f"crashed (exit {p.returncode}): {tail}")


def _child(name: str) -> None:
    import logging
    import warnings

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch  # noqa: F401 - before the device comes: a child started early has it loaded

    device = sys.stdin.readline().strip()
    if not device:
        return  # not needed after all
    try:
        res = LibResult(name, True, CHECKS[name](device))
    except Exception as e:  # noqa: BLE001 - the failure is the result
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        res = LibResult(name, False, f"{type(e).__name__}: {msg[:200]}")
    print(json.dumps(asdict(res)))
