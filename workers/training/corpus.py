"""The training corpus: the Python standard library's own *.py source, split by whole files.

A file is held out when the hash of its path relative to the stdlib root falls in the first
HELDOUT_PERCENT of 100 buckets, so the split is the same on every machine and Python version
(a file present in both versions lands on the same side). Each file becomes
[bos] + tokens + [eos]; files are concatenated into one uint16 stream per split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig

import numpy as np

HELDOUT_PERCENT = 3
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str) -> bool:
    """Deterministic by file name: sha1 of the '/'-separated path relative to the stdlib."""
    digest = hashlib.sha1(relpath.replace(os.sep, "/").encode()).hexdigest()
    return int(digest[:8], 16) % 100 < HELDOUT_PERCENT


def list_files(root: str | None = None) -> list[str]:
    """Relative paths of every readable *.py file under the stdlib, sorted."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def read_text(root: str, relpath: str) -> str | None:
    try:
        with open(os.path.join(root, relpath), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def split_files(root: str | None = None) -> tuple[list[str], list[str]]:
    files = list_files(root)
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def build(out_dir: str, vocab_size: int = 4096, root: str | None = None) -> dict:
    """Train the tokenizer on the train split and write train.u16 / heldout.u16 + manifest."""
    from transformers import PreTrainedTokenizerFast

    from workers.tiny_model import train_tokenizer

    root = root or stdlib_root()
    train, heldout = split_files(root)
    texts = {f: read_text(root, f) for f in train + heldout}
    train = [f for f in train if texts[f]]
    heldout = [f for f in heldout if texts[f]]
    tok_dir = os.path.join(out_dir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    train_tokenizer(vocab_size, tok_dir, corpus=[texts[f] for f in train])
    tok = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    manifest = {"stdlib": root, "vocab_size": vocab_size, "heldout_percent": HELDOUT_PERCENT}
    for split, files in (("train", train), ("heldout", heldout)):
        ids = tok([texts[f] for f in files], add_special_tokens=False)["input_ids"]
        stream = []
        for doc in ids:
            stream += [tok.bos_token_id, *doc, tok.eos_token_id]
        np.asarray(stream, dtype=np.uint16).tofile(os.path.join(out_dir, f"{split}.u16"))
        manifest[split] = {"files": files, "num_tokens": len(stream)}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Tokenize the stdlib corpus for training")
    p.add_argument("--out", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    a = p.parse_args()
    m = build(a.out, a.vocab_size)
    print({k: (v["num_tokens"], len(v["files"])) for k, v in m.items() if isinstance(v, dict)})
