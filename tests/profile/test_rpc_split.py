"""Where a target's layers go over this machine and RPC servers (profile/split.py), and the
`[target] rpc` settings: the run sizes chosen here are the ones llama.cpp's layer split
lands on (its rule, from llama_model_base::load_tensors, re-run below in float32)."""

from __future__ import annotations

import numpy as np
import pytest

from minions_local.core.errors import ProfileError
from minions_local.profile.split import HERE, place_layers


def llama_cpp_devices(n_layers: int, n_gpu_layers: int, tensor_split: list[float]) -> list[int]:
    """Per layer (the head last): -1 for the CPU, else the index of the device llama.cpp picks."""
    splits = np.cumsum(np.array(tensor_split, dtype=np.float32), dtype=np.float32)
    splits = (splits / splits[-1]).astype(np.float32)
    start = max(n_layers + 1 - n_gpu_layers, 0)
    act = min(n_gpu_layers, n_layers + 1)
    out = []
    for il in range(n_layers + 1):
        if il < start or il - start >= act:
            out.append(-1)
            continue
        x = np.float32(il - start) / np.float32(act)
        out.append(int(np.searchsorted(splits, x, side="right")))
    return out


@pytest.mark.parametrize("layers", [1, 2, 7, 30, 32, 80])
def test_the_split_is_where_llama_cpp_puts_the_layers(layers):
    rng = np.random.default_rng(layers)
    for _ in range(200):
        servers = [f"10.0.0.{i}:50052" for i in range(int(rng.integers(1, 5)))]
        shares = [float(x) for x in rng.choice([0.0, 0.5, 1.0, 3.0, 24e9, 7.3e9], len(servers) + 1)]
        if not any(shares[1:]):
            shares[-1] = 1.0
        placed = place_layers([100] * layers, 10, servers, shares)
        assert placed.n_layers == layers and placed.places == (HERE, *servers)
        assert placed.used_servers, "some server always holds a layer"
        got = llama_cpp_devices(layers, placed.n_gpu_layers, placed.tensor_split())
        want = [-1] * placed.layers[0]
        for k, i in enumerate(placed.used_servers):
            want += [k] * placed.layers[i]
        assert got == want + [len(placed.used_servers) - 1]  # the head's slot: the last server (its tensor is overridden here)


def test_shares_round_by_largest_remainder_and_say_where_each_run_is():
    placed = place_layers([1_000_000_000] * 10, 500_000_000, ["a:1", "b:2"], [1, 1, 1], input_bytes=200_000_000)
    assert placed.layers == (4, 3, 3)  # equal remainders: the first place takes the extra layer
    assert placed.layer_bytes == (4e9, 3e9, 3e9) and placed.bytes_at(0) == 4.7e9 and placed.bytes_at(2) == 3e9  # the head here
    assert placed.runs()[0] == (HERE, 0, placed.layers[0])
    text = placed.describe()
    assert "this machine: layers 0-3 + the output head" in text and "b:2: layers 7-9 (3.00 GB)" in text
    only_servers = place_layers([1] * 4, 1, ["a:1", "b:2"], [0, 1, 1])
    assert only_servers.layers == (0, 2, 2) and "this machine: embeddings + the output head" in only_servers.describe()
    with pytest.raises(ValueError, match="some server's share above 0"):
        place_layers([1] * 4, 1, ["a:1"], [1, 0])


def test_profile_rpc_settings_are_checked(tmp_path):
    from minions_local.planning.fitting import with_rpc
    from minions_local.profile import load_profile

    profile = load_profile("cpu-demo")
    with pytest.raises(ProfileError, match="GGUF target"):  # cpu-demo's target is not a GGUF
        with_rpc(profile, ["127.0.0.1:50052"], None)
    gguf = profile.model_copy(update={"target": profile.target.model_copy(update={"format": "gguf"})})
    for bad, why in ((["[::1]:50052"], "not host:port"), (["host"], "not host:port")):
        with pytest.raises(ProfileError, match=why):
            with_rpc(gguf, bad, None)
    with pytest.raises(ProfileError, match="rpc_split needs 3 shares"):
        with_rpc(gguf, ["a:1", "b:2"], [1, 1])
    with pytest.raises(ProfileError, match="some server's above 0"):
        with_rpc(gguf, ["a:1"], [1, 0])
    split = with_rpc(gguf, ["a:1", "b:2"], [0, 1, 2]).target
    assert split.rpc == ["a:1", "b:2"] and split.rpc_split == [0, 1, 2]
