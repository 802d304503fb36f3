"""The seams between the reference model and the CPU fast path (hybridcache/ops/kernels.py, hybridcache/accel/
slots.py, install.py): what blocks are told the kernels compute is what the kernels declare, the cache offers the
methods the fast path uses, and the registry refuses what it cannot install."""

import pytest
import torch

import hybridcache.accel as accel
from hybridcache.accel.install import AccelError, register_accel
from hybridcache.accel.native import op_declarations
from hybridcache.accel.native.kernel_calls import call, takes
from hybridcache.accel.slots import AttentionSlots, ReservingCache
from hybridcache.cache import Cache, NativeLayer
from hybridcache.ops import kernels


def test_the_seam_declares_what_the_kernels_compute():
    assert kernels.WEIGHT_DTYPES == set(op_declarations.WEIGHT_KERNELS) == set(op_declarations.WEIGHT_TYPES)
    assert kernels.ACTIVATIONS == set(op_declarations.ACT_MUL)


def test_importing_accel_plugs_the_seam():
    assert accel is not None and kernels.takes is takes and kernels.call is call


def test_the_cache_offers_what_the_fast_path_uses():
    spec = {"num_kv_heads": 2, "head_dim": 4, "dtype": torch.float32}
    cache = Cache.build([NativeLayer("full", dict(spec)), NativeLayer("sliding", {**spec, "window": 4})], 1)
    assert isinstance(cache, ReservingCache)
    assert all(isinstance(layer, AttentionSlots) for layer in cache.layers)
    # the methods whose results the fast path reads, called as it calls them
    with cache.block(tokens=1):
        for layer in cache.layers:
            view, slot = layer.decode_slot()
            assert view.keys.shape[2] == slot + 1 and view.pattern() is not None
            view.keys.narrow(2, slot, 1).zero_()
            view.values.narrow(2, slot, 1).zero_()
    reserved = cache.reserve_decode(3)
    assert reserved is not None and len(reserved) == 2
    assert all((r.start, r.end) == (0, 1) and r.keys.shape[2] >= 4 for r in reserved)
    cache.feed_reserved(None)  # nothing fed: the cache is what it was
    assert cache.seq.seen.tolist() == [1]


@pytest.mark.parametrize(
    "cls, make", [(object, lambda m: None), ("AttentionMixer", lambda m: None), (torch.nn.Linear, 3)]
)
def test_the_registry_refuses_what_it_cannot_install(cls, make):
    from hybridcache.accel.install import ACCELS

    before = dict(ACCELS)
    with pytest.raises(AccelError, match="register_accel takes"):
        register_accel(cls, make)
    assert ACCELS == before


@pytest.mark.parametrize("what", [None, "model", torch.zeros(2)])
def test_install_refuses_what_is_no_module(what):
    with pytest.raises(AccelError, match="takes an nn.Module"):
        accel.install(what)
    with pytest.raises(AccelError, match="takes an nn.Module"):
        accel.uninstall(what)
