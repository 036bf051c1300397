"""Optional packages a command does not use are kept out of its process.

peft and diffusers import bitsandbytes whenever it is installed, and its import pulls in torch's compiler
(`torch._inductor`, ~180 modules): on the CI machine (2 cores, 2026-11-29) a 4-step tiny FLUX `lorakit train` took
13.0 s from the command to its result with it and 11.2 s without it (first step 4.3 s -> 2.8 s; three runs each, the
same in each). A run needs it for 8-bit AdamW states and an nf4 base (`plan.memory.needs_bitsandbytes`), and the
stock loaders need it for a model folder whose components were saved quantized by it; every other `lorakit train`,
`cache` and `infer` leaves it out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lorakit.errors import STOP


def leave_out_bitsandbytes(needed: bool, folder=None) -> bool:
    """Make bitsandbytes read as not installed to everything this process imports from now on, unless `needed` or
    the model `folder` holds a component saved quantized by it (`saved_by_bitsandbytes`, read only where the rest
    would leave it out). Its availability checks (`importlib.util.find_spec`, which peft and diffusers call) answer
    None and an import raises ImportError, as where it is not installed. Only in a process of lorakit's own (the
    console script, `python -m lorakit`, a launcher's workers) and only where nothing has imported it yet: a host
    program running the CLI in its own process (typer's test runner) keeps its modules as they are. Returns whether
    it was left out."""
    if needed or not STOP.get("entry") or "bitsandbytes" in sys.modules or saved_by_bitsandbytes(folder):
        return False
    sys.modules["bitsandbytes"] = None  # the import system's own "not importable" mark
    return True


def saved_by_bitsandbytes(folder) -> bool:
    """Does a component of this model folder (its `*/config.json`, or the folder's own) declare weights quantized by
    bitsandbytes? The stock loaders import it for such a component."""
    root = Path(folder) if folder else None
    if root is None or not root.is_dir():
        return False
    for path in [root / "config.json", *root.glob("*/config.json")]:
        try:
            quant = json.loads(path.read_text()).get("quantization_config") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(quant, dict) and (quant.get("quant_method") == "bitsandbytes" or quant.get("load_in_4bit")
                                        or quant.get("load_in_8bit")):
            return True
    return False
