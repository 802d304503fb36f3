"""Checkpoint directories treated as untrusted (issue 22, "Files"): a checkpoint file that is a symbolic link out
of the checkpoint directory is refused by its real path; links that stay inside (or a hub cache's blobs) load."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hybridcache as hc
from tests.models.conftest import prompts


@pytest.fixture
def gemma_dir(checkpoints, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoints("gemma3"), target)
    return target


def shard_in_two(directory, second="b.safetensors"):
    """Split model.safetensors into a.safetensors and `second` with an index; the second shard's real file is
    written at directory / second (the caller may move it and leave a link)."""
    state = load_file(directory / "model.safetensors")
    names = sorted(state)
    half = {"a.safetensors": names[: len(names) // 2], second: names[len(names) // 2 :]}
    for file, keys in half.items():
        save_file({k: state[k] for k in keys}, directory / file)
    (directory / "model.safetensors").unlink()
    weight_map = {k: file for file, keys in half.items() for k in keys}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_shard_linked_outside_the_checkpoint_is_refused(gemma_dir, tmp_path):
    shard_in_two(gemma_dir)
    outside = tmp_path / "elsewhere" / "b.safetensors"
    outside.parent.mkdir()
    os.replace(gemma_dir / "b.safetensors", outside)
    os.symlink(outside, gemma_dir / "b.safetensors")  # a plain name in the index, a link out of the directory
    with pytest.raises(hc.models.CheckpointError, match=r"shard 'b.safetensors' is a symbolic link to .*elsewhere"):
        hc.from_pretrained(gemma_dir)
    os.unlink(gemma_dir / "b.safetensors")  # a link in a subfolder that climbs out with a relative target
    (gemma_dir / "sub").mkdir()
    os.symlink(os.path.relpath(outside, gemma_dir / "sub"), gemma_dir / "sub" / "b.safetensors")
    index = gemma_dir / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"b.safetensors"', '"sub/b.safetensors"'))
    with pytest.raises(hc.models.CheckpointError, match="symbolic link"):
        hc.from_pretrained(gemma_dir)


def test_a_linked_directory_on_the_way_out_is_refused(gemma_dir, tmp_path):
    shard_in_two(gemma_dir)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.replace(gemma_dir / "b.safetensors", outside / "b.safetensors")
    os.symlink(outside, gemma_dir / "weights")  # a folder inside that is a link to one outside
    index = gemma_dir / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"b.safetensors"', '"weights/b.safetensors"'))
    with pytest.raises(hc.models.CheckpointError, match="symbolic link"):
        hc.from_pretrained(gemma_dir)


def test_single_file_and_index_linked_outside_are_refused(gemma_dir, tmp_path):
    outside = tmp_path / "model.safetensors"
    os.replace(gemma_dir / "model.safetensors", outside)
    os.symlink(outside, gemma_dir / "model.safetensors")
    with pytest.raises(hc.models.CheckpointError, match="model.safetensors is a symbolic link"):
        hc.from_pretrained(gemma_dir)
    os.unlink(gemma_dir / "model.safetensors")
    os.replace(outside, gemma_dir / "model.safetensors")
    shard_in_two(gemma_dir)
    os.replace(gemma_dir / "model.safetensors.index.json", tmp_path / "index.json")
    os.symlink(tmp_path / "index.json", gemma_dir / "model.safetensors.index.json")
    with pytest.raises(hc.models.CheckpointError, match="index.json is a symbolic link"):
        hc.from_pretrained(gemma_dir)


def test_links_inside_the_checkpoint_and_hub_cache_blobs_still_load(gemma_dir, tmp_path, models):
    ours, _ = models("gemma3")
    ids = prompts(1, 5, seed=3)
    shard_in_two(gemma_dir)
    (gemma_dir / "store").mkdir()
    os.replace(gemma_dir / "b.safetensors", gemma_dir / "store" / "b.safetensors")
    os.symlink("store/b.safetensors", gemma_dir / "b.safetensors")  # a link that stays inside
    with torch.no_grad():
        assert torch.equal(hc.from_pretrained(gemma_dir)(ids), ours(ids))
    # the Hugging Face hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in gemma_dir.iterdir():
        if f.is_file() and not f.is_symlink():
            os.replace(f, blobs / f.name)
            os.symlink(os.path.join("..", "..", "blobs", f.name), snapshot / f.name)
    os.replace(gemma_dir / "store" / "b.safetensors", blobs / "b.safetensors")
    os.symlink(os.path.join("..", "..", "blobs", "b.safetensors"), snapshot / "b.safetensors")
    with torch.no_grad():
        assert torch.equal(hc.from_pretrained(snapshot)(ids), ours(ids))
