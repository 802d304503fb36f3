"""Saved caches for the file-format tests (tests/models/test_cache_files_hostile.py, tests/hostile/test_files.py):
one jamba cache to save, and files forged the way an attacker would (tensors and header edited, then the unkeyed
hashes recomputed here from the documented algorithm, hashlib over canonical JSON / tensor bytes, not with our own
helpers)."""

import hashlib
import json

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hybridcache as hc
from tests.models.conftest import prompts


def save_jamba_cache(models, directory):
    """A jamba cache (mamba layers 0, 1, 3; full attention layer 2), a left-padded batch of 2, saved under
    `directory`: (model, cache, path)."""
    model = models("jamba")[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    out = hc.generate(model, prompts(2, 9, seed=7), attention_mask=mask, max_new_tokens=3)
    path = directory / "c.safetensors"
    out.cache.save(path, model=model)
    return model, out.cache, path


def read(path):
    with safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["hybridcache"])
    return header, load_file(str(path))


def forge(path, out, header, tensors):
    """Write `header` and `tensors` with both unkeyed hashes recomputed, as anyone can."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    header = {**header, "payload_sha256": h.hexdigest()}
    body = {k: v for k, v in header.items() if k != "header_sha256"}
    header["header_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    save_file(tensors, str(out), metadata={"hybridcache": json.dumps(header)})
    return out
