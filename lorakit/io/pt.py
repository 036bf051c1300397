"""Reading PyTorch `.pt` files without running code: `torch.load(weights_only=True)`, its refusals said plainly.

A `.pt` file is a pickle; unpickling an arbitrary one can run any code. lorakit reads them (legacy caches, its own
checkpoint states) with PyTorch's weights-only unpickler, which takes tensors and plain containers and refuses
anything else. Its refusal is a page of advice about turning that protection off; here it becomes one line saying
what the file holds.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from pathlib import Path

from lorakit.errors import FileFormatError, short

_WHAT = (
    (re.compile(r"Unsupported global: GLOBAL ([\w.]+)"), "a pickled {} object"),
    (re.compile(r"unsupported GLOBAL ([\w.]+)"), "a call to {}"),
    (re.compile(r"Unsupported operand (\d+)"), "pickle instructions other than data (opcode {})"),
)


class NotPlainData(FileFormatError):
    """A .pt file that holds more than tensors and plain containers (refused: loading it would run code)."""


def load_pt(path, map_location="cpu") -> object:
    """The contents of a .pt file, read without running code (tensors to `map_location`; None: where they were
    saved from).

    Raises:
        NotPlainData: it holds objects other than tensors and plain containers (named).
        FileFormatError: it is missing, cut off or not a PyTorch file.
    """
    import torch

    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unpickler's notes about pickle protocols
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        text = str(e)
        if "Weights only load failed" not in text:
            raise FileFormatError(f"{path}: not a readable .pt file ({short(e, 120)})") from None
        found = next((form.format(m.group(1)) for rx, form in _WHAT for m in [rx.search(text)] if m), None)
        raise NotPlainData(f"{path}: refused: it holds {found or 'objects other than tensors'} — loading it could "
                           "run code, and lorakit reads .pt files as data only (PyTorch's weights_only)",
                           "only tensors, numbers, strings and lists or dicts of them are read") from None
    except FileNotFoundError:
        raise FileFormatError(f"{path}: missing") from None
    except (RuntimeError, EOFError, ValueError, AttributeError, TypeError, KeyError, OSError,
            zipfile.BadZipFile) as e:
        raise FileFormatError(f"{path}: not a readable .pt file ({short(e, 120)})") from None
