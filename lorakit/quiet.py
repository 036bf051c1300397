"""Keep third-party chatter (progress bars, deprecation notes, optional-kernel notices) off the console.

lorakit shows its own progress; LORAKIT_DEBUG=1 leaves the libraries' output alone.
"""

from __future__ import annotations

import logging
import os
import warnings

from lorakit.pkgmap import use_cached_package_map


def quiet_libraries(imports: bool = True) -> None:
    """Silence diffusers/transformers/huggingface_hub/bitsandbytes below errors (idempotent). Called before
    anything imports them: their import-time package scan is answered from lorakit's cache (`lorakit.pkgmap`).
    `imports=False` imports none of them (their loggers and variables are set; diffusers' progress bar is turned off
    by the call with imports): a run first decides which of them it leaves out (`lorakit.unused`)."""
    use_cached_package_map()
    if os.environ.get("LORAKIT_DEBUG", "") not in ("", "0"):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in ("bitsandbytes", "diffusers", "transformers", "huggingface_hub", "peft", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    # torch's note that a norm with bf16 weights got fp32 input (Kandinsky 5 keeps such modules in fp32, as
    # diffusers does): the result is right, the fused kernel is not used; said once per compile otherwise
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    # peft, when `lorakit infer --lora A --lora B` loads a second adapter beside the first (lorakit asks for that)
    warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute in the model")
    # torch.distributed.checkpoint in a one-process run (lorakit asks for that on purpose)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    if not imports:
        return
    try:
        from diffusers.utils import logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
    except ImportError:
        pass
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except ImportError:
        pass
