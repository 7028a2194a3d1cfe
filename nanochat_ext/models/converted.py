"""A converted model dir (gguf_import writes them): MARKER, the file written last, and whether a dir holds a complete,
checked conversion. The standard library only: scripts.kat_fetch_model's cached call answers from it in milliseconds,
where importing torch alone takes a second warm and several cold.
"""
from __future__ import annotations

import os
from pathlib import Path

MARKER = "gguf_conversion.json"  # written last: what was converted and what the check measured


def is_converted(out_dir: str | os.PathLike) -> bool:
    """Whether out_dir holds a complete, checked conversion (its MARKER is written last)."""
    return (Path(out_dir) / MARKER).is_file()
