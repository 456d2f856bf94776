"""The int4 kernel path of a GGUF target (offload/gguf_int4.py): each 4-bit type's
blocks turned into the kernel's (scale, zero) form, its matmul against those weights,
row invariance, and a streamed target that uses it."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from minions_local.core.errors import ModelLoadError  # noqa: E402
from minions_local.offload import gguf_int4  # noqa: E402
from minions_local.offload.binding import layer_weights, uses_int4_kernel  # noqa: E402
from minions_local.offload.gguf_blocks import block_type, dequantize  # noqa: E402
from minions_local.offload.gguf_streamed import load_streamed_gguf  # noqa: E402
from tests.helpers.tiny_gguf import write_gguf  # noqa: E402
from tests.helpers.tiny_models import random_model, save, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not gguf_int4.available("cpu"), reason="torch lacks the int4 CPU kernel")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


def random_blocks(kind: str, shape: tuple[int, int], *, bf16_scales: bool, seed: int = 0) -> torch.Tensor:
    """Random blocks whose float16 fields are sane scales (bf16-representable if asked:
    then the kernel's weights are the file's exactly)."""
    btype = block_type(kind)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (btype.nbytes(shape),), dtype=torch.uint8, generator=g)
    blocks = raw.view(-1, btype.type_size)
    n = blocks.shape[0]
    for byte, sign in ((0, 1.0), (2, -1.0)):  # d, then m (Q4_1) or dmin (Q4_K)
        if kind == "Q4_0" and byte == 2:
            break
        values = sign * (torch.rand(n, generator=g) * 0.05 + 0.001)
        if bf16_scales:
            values = values.to(torch.bfloat16).to(torch.float32)
        if kind == "Q4_K" and byte == 2:
            values = values.abs()  # dmin is subtracted by the format
        blocks[:, byte:byte + 2] = values.to(torch.float16).view(torch.uint8).view(n, 2)
    return raw


@pytest.mark.parametrize("kind", gguf_int4.INT4_TYPES)
def test_the_kernels_weights_are_the_files_where_bf16_holds_the_scales(kind) -> None:
    shape = (64, 512)
    exact = dequantize(random_blocks(kind, shape, bf16_scales=True), kind, shape)
    reference = torch.from_numpy(gguf.quants.dequantize(random_blocks(kind, shape, bf16_scales=True).numpy(),
                                                        getattr(gguf.GGMLQuantizationType, kind)).copy())
    assert torch.equal(exact, reference.reshape(shape))
    # Q4_0 has no zero: its weights are the file's. Q4_1's zero m + 8 d and Q4_K's
    # scale d * sc need more bits than bf16 has, whatever d and m are.
    if kind == "Q4_0":
        assert torch.equal(gguf_int4.weights(random_blocks(kind, shape, bf16_scales=True), kind, shape), exact)
    # Any scales: each weight moves by at most bf16's rounding of its scale and zero.
    raw = random_blocks(kind, shape, bf16_scales=False, seed=1)
    exact = dequantize(raw, kind, shape)
    _, scale, zero = gguf_int4.affine(raw, kind, shape)
    bound = (8 * scale.abs() + zero.abs()).repeat_interleave(gguf_int4.GROUP, dim=1) * 2.0 ** -8
    assert ((gguf_int4.weights(raw, kind, shape) - exact).abs() <= bound).all()


@pytest.mark.parametrize("kind", gguf_int4.INT4_TYPES)
def test_the_kernel_multiplies_by_those_weights_and_each_row_as_alone(kind) -> None:
    shape = (96, 256)
    raw = random_blocks(kind, shape, bf16_scales=False)
    weight = gguf_int4.Int4Weight(*gguf_int4.pack(raw, kind, shape))
    assert weight.shape == shape
    x = torch.randn(1, 17, shape[1], generator=torch.Generator().manual_seed(2))
    bias = torch.randn(shape[0])
    got = weight(x, bias)
    want = x.to(torch.bfloat16).float() @ gguf_int4.weights(raw, kind, shape).T + bias
    assert got.dtype == torch.float32 and got.shape == (1, 17, shape[0])
    # the kernel's output is bfloat16: within its rounding of the largest output
    assert (got - want).abs().max() <= 2.0 ** -7 * want.abs().max()
    for i in range(17):
        assert torch.equal(weight(x[:, i:i + 1], bias)[0, 0], got[0, i])


def test_packs_record_the_cpus_kernel_layout() -> None:
    tag = gguf_int4.layout_tag()
    assert len(tag) == 10 and tag == gguf_int4.layout_tag()


@pytest.mark.parametrize("arch,kind,hidden", [("llama", "Q4_1", 64), ("qwen2", "Q4_K", 256), ("mistral", "Q4_0", 64)])
def test_a_streamed_target_multiplies_its_4bit_layers_in_place(arch, kind, hidden, tmp_path, tokenizer) -> None:
    from minions_local.backends.hf_target import StreamedCompactTarget, exact_target
    from minions_local.core.tree import TokenTree

    config = tiny_config(arch, hidden=hidden)
    folder = save(random_model(config, seed=1), tmp_path / "m", tokenizer)
    path = write_gguf(folder, tmp_path / "m.gguf", kind, embedding_type="Q8_0" if hidden == 64 else "Q6_K")
    exact, _ = load_streamed_gguf(path, tier="disk", cache_dir=tmp_path / "packs", kernel="dequant")
    packed, stats = load_streamed_gguf(path, tier="disk", cache_dir=tmp_path / "packs", kernel="int4")
    assert all(layer_weights(layer).int4 for layer in packed.model.layers)
    assert uses_int4_kernel(packed) and not uses_int4_kernel(exact)
    # In the kernel's form, 16 bytes of integers + 4 of scale and zero per 32 weights:
    # Q4_1's own size, a ninth more than Q4_0's and Q4_K's
    planar = sum(p.nbytes for p in layer_weights(exact.model.layers[0]).layout.pieces)
    kernels = sum(p.nbytes for p in layer_weights(packed.model.layers[0]).layout.pieces)
    assert kernels == planar if kind == "Q4_1" else planar < kernels <= planar * 10 / 9 + 64
    with pytest.raises(RuntimeError, match="gguf_kernel='dequant'"):
        packed(torch.tensor([[1, 2, 3]]))  # transformers' forward cannot multiply int4 weights
    target = exact_target(packed)
    assert isinstance(target, StreamedCompactTarget)
    prompt, tree = [1, 5, 9, 22, 40, 3, 17], TokenTree.from_root(17)
    for parent, token in ((0, 4), (1, 8), (0, 11)):
        tree.add(parent, token)
    want = exact_target(exact).verify(prompt, tree)
    got = target.verify(prompt, tree)
    # a different kernel on the same blocks: close, not equal
    assert not torch.equal(got, want)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


def test_int4_needs_every_layer_matrix_in_4_bits(tmp_path, tokenizer) -> None:
    folder = save(random_model(tiny_config("llama"), seed=1), tmp_path / "m", tokenizer)
    path = write_gguf(folder, tmp_path / "mixed.gguf", "Q4_0", types={"blk.1.ffn_down.weight": "Q8_0"})
    with pytest.raises(ModelLoadError, match="also has Q8_0"):
        load_streamed_gguf(path, tier="disk", cache_dir=tmp_path / "packs", kernel="int4")
    model, _ = load_streamed_gguf(path, tier="disk", cache_dir=tmp_path / "packs")  # auto: dequantized
    assert not uses_int4_kernel(model)
    with pytest.raises(ModelLoadError, match="gguf_kernel 'fast' is not one of"):
        load_streamed_gguf(path, tier="disk", cache_dir=tmp_path / "packs", kernel="fast")


def test_batched_trees_through_the_int4_kernel_reply_as_each_request_alone(tmp_path, tokenizer) -> None:
    import shutil

    from minions_local import Engine
    from minions_local.models.gguf_target import side_folder
    from tests.helpers.tiny_models import noisy_copy

    target = random_model(tiny_config("llama", layers=3), seed=3, scale=25.0)
    path = write_gguf(save(target, tmp_path / "target", tokenizer), tmp_path / "target.gguf", "Q4_1")
    minion = save(noisy_copy(target, seed=4, noise=0.05), tmp_path / "minion")
    for f in side_folder(path).glob("*token*"):
        shutil.copy(f, minion / f.name)
    options = {"cache_dir": str(tmp_path / "packs"), "buffers": 2, "kernel": "int4"}
    alone = Engine.from_pretrained(path, [], target_tier="disk", stream_options=options)
    engine = Engine.from_pretrained(path, [str(minion), "ngram"], target_tier="disk", budget=8,
                                    stream_options=options)
    prompts = [[1, 5, 9, 22], [1, 40, 41, 3, 3, 7], [2, 8, 8, 8, 30], [1, 12]]
    want = [alone.generate(p, max_new_tokens=20).token_ids for p in prompts]
    got = engine.generate_batch(prompts, max_new_tokens=20)
    assert [g.token_ids for g in got] == want
    steps = [s for g in got for s in g.steps]
    assert max(s.batch_size for s in steps) > 1  # the requests shared passes
    assert any(s.pass_rows > s.batch_size for s in steps)  # with trees in them
