"""Every weight read and write in lorakit goes through here (see reader.py, writer.py, header.py)."""

from lorakit.io.header import Header, TensorInfo, read_header
from lorakit.io.reader import BACKENDS, load, resolve_files
from lorakit.io.writer import (
    atomic_path,
    clean_orphans,
    link_or_copy,
    save,
    save_sharded,
    shared_mode,
    shared_tree,
)

__all__ = ["BACKENDS", "Header", "TensorInfo", "atomic_path", "clean_orphans", "link_or_copy", "load", "read_header",
           "resolve_files", "save", "save_sharded", "shared_mode", "shared_tree"]
