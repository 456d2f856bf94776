"""The GGUF header reader on a vocabulary's string arrays: read whole, and a damaged one named."""

import struct

import pytest

from minions_local.core.errors import ModelLoadError
from minions_local.models.gguf_file import read_gguf

TOKENS = ["<s>", "héllo", "", "▁world"]


def _header(tokens: list[bytes]) -> bytes:
    key = b"tokenizer.ggml.tokens"
    body = b"".join(struct.pack("<Q", len(t)) + t for t in tokens)
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, len(tokens)) + body)  # an array (9) of strings (8)


def test_a_string_array_reads_whole(tmp_path):
    path = tmp_path / "vocab.gguf"
    path.write_bytes(_header([t.encode() for t in TOKENS]))
    assert read_gguf(path).metadata["tokenizer.ggml.tokens"] == TOKENS


@pytest.mark.parametrize("damage, said", [
    (lambda data: data[:-5], "the file ends inside its header (truncated)"),      # inside the last string
    (lambda data: data[:-len("▁world".encode()) - 4], "the file ends inside its header (truncated)"),  # inside a length
    (lambda data: data.replace("héllo".encode(), b"h\xe9llo!"), "a header string is not UTF-8"),
    (lambda data: data.replace(struct.pack("<Q", 6) + "héllo".encode(), struct.pack("<Q", 2**40) + b"hello!"),
     "is longer than the file"),
])
def test_a_damaged_string_array_is_named(tmp_path, damage, said):
    path = tmp_path / "vocab.gguf"
    path.write_bytes(damage(_header([t.encode() for t in TOKENS])))
    with pytest.raises(ModelLoadError, match="vocab.gguf is not a readable GGUF file") as err:
        read_gguf(path)
    assert said in str(err.value) and "Re-download" in str(err.value)
