"""A GGUF file read as a target: header, config, tokenizer; every defect a ModelLoadError naming it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

from minions_local.core.errors import ModelLoadError  # noqa: E402
from minions_local.models.gguf_file import GGML_TYPES, read_gguf  # noqa: E402
from minions_local.models.gguf_target import ensure_side_folder, hf_rows, open_target  # noqa: E402
from tests.helpers.tiny_gguf import write_gguf  # noqa: E402
from tests.helpers.tiny_models import random_model, save, tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("hf")
    return {arch: save(random_model(tiny_config(arch), seed=1), root / arch, tokenizer)
            for arch in ("llama", "qwen2", "mistral")}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_CACHE_DIR", str(tmp_path / "cache"))


def test_type_table_matches_gguf_package() -> None:
    import gguf

    for kind, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if int(kind) in GGML_TYPES:
            assert GGML_TYPES[int(kind)] == (kind.name, block, size)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_config_tokenizer_and_index(arch, hf_models, tmp_path, tokenizer) -> None:
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    path = write_gguf(hf_models[arch], tmp_path / f"{arch}.gguf", "Q4_0")
    target = open_target(path)
    want = AutoConfig.from_pretrained(hf_models[arch])
    expected_arch = "qwen2" if arch == "qwen2" else "llama"  # llama.cpp writes Mistral as Llama
    assert target.file.architecture == expected_arch
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert target.config[key] == getattr(want, key), key
    assert target.config["head_dim"] == want.hidden_size // want.num_attention_heads
    assert target.config["rope_parameters"]["rope_theta"] == want.rope_parameters["rope_theta"]
    # The index agrees with the gguf package's own reader, byte for byte.
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        info = target.file.tensors[t.name]
        assert (info.offset, info.nbytes, info.type_name) == (t.data_offset, t.n_bytes, t.tensor_type.name)
        assert info.shape == tuple(int(s) for s in reversed(t.shape.tolist()))
    assert set(target.layer_tensors(1).values()) == {n for n in target.file.tensors if n.startswith("blk.1.")}
    folder = ensure_side_folder(target)
    assert ensure_side_folder(target) == folder  # cached
    loaded = AutoTokenizer.from_pretrained(folder)
    vocab = loaded.backend_tokenizer.get_vocab(False)  # the GGUF pads it to the embedding's rows
    assert all(vocab[token] == i for token, i in tokenizer.backend_tokenizer.get_vocab(False).items())
    if arch != "qwen2":  # transformers gives a 'qwen2' GGUF Qwen2's own pre-tokenizer, as real ones need
        text = "def add(a, b):\n    return a + b\n"
        assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.chat_template == tokenizer.chat_template
    assert AutoConfig.from_pretrained(folder).model_type == expected_arch


def test_llama_rows_are_put_back_in_transformers_order() -> None:
    rows = np.arange(4 * 8)
    permuted = rows.reshape(4, 2, 4).swapaxes(1, 2).reshape(-1)  # what llama.cpp's converter writes
    assert list(permuted[hf_rows(4, 32)]) == list(rows)


def test_damaged_and_unsupported_files_are_named(hf_models, tmp_path) -> None:
    good = write_gguf(hf_models["llama"], tmp_path / "good.gguf", "Q8_0")
    data = good.read_bytes()
    cases = {
        "missing.gguf": (None, "does not exist"),
        "not-gguf.gguf": (b"PK\x03\x04" + data[4:], "GGUF magic"),
        "header-cut.gguf": (data[:3000], "truncated"),
        "data-cut.gguf": (data[: len(data) - 100], "past the end of the file"),
        "version.gguf": (data[:4] + (7).to_bytes(4, "little") + data[8:], "GGUF version 7"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(ModelLoadError, match=message) as err:
            open_target(path)
        assert str(path) in str(err.value)
    phi = write_gguf(hf_models["llama"], tmp_path / "phi.gguf", "Q8_0", architecture="phi3")
    with pytest.raises(ModelLoadError, match="'phi3' model; a GGUF target may be llama, mistral, qwen2"):
        open_target(phi)
    scaled = write_gguf(hf_models["llama"], tmp_path / "rope.gguf", "Q8_0",
                        extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        open_target(scaled)
    assert read_gguf(good).tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
