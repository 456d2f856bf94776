"""Tiny GGUF targets written inside the tests, from a tiny HF model, in chosen block types.

32-weight types (Q4_0, Q4_1, Q5_0, Q8_0) and F16/BF16 are quantized by the `gguf`
package's own quantizer; it has none for the k-quants, so their tensors are random
blocks with small scales (the target is whatever its blocks say, which is all an
equivalence test needs).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minions_local.backends.gguf_export import iter_tensors, read_hyperparams, read_vocab

K_QUANTS = {"Q4_K": (144, [0, 2]), "Q5_K": (176, [0, 2]), "Q6_K": (210, [208])}
"""Bytes per 256-weight block, and where its float16 scales lie."""


def k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random `kind` blocks whose weights stay within about +-0.1, as bytes [rows, row_bytes]."""
    size, scales = K_QUANTS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for byte in scales:
        d = rng.uniform(2e-5, 1e-4, size=(raw.shape[0], 1)).astype(np.float16)
        raw[:, byte : byte + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(src: Path, out: Path, layer_type: str = "Q4_1", *, embedding_type: str = "Q8_0",
               types: dict[str, str] | None = None, architecture: str | None = None, skip: tuple = (),
               extra_tensors: dict[str, np.ndarray] | None = None, seed: int = 0, shard_tensors: int = 0,
               chat_template: bool = True) -> Path:
    """Write the HF folder `src` as a GGUF at `out`: 2-D layer weights in `layer_type`
    (or `types[gguf name]`), the embedding (and an untied head) in `embedding_type`,
    norms in F32. `skip` leaves tensors out, `architecture` overrides the name in the file.
    `shard_tensors`: split the model into files of that many tensors, as llama.cpp's
    gguf-split does (the `split.*` keys in each; the metadata in the first, named
    OUT-00001-of-0000N.gguf), and return the first. `chat_template`: write the tokenizer's."""
    import gguf

    hparams = read_hyperparams(src)
    vocab = read_vocab(src, hparams.vocab_size)
    writer = gguf.GGUFWriter(str(out), architecture or hparams.architecture, split_max_tensors=shard_tensors)
    writer.add_name(src.name)
    hparams.add_to(writer)
    vocab.add_to(writer)
    if vocab.chat_template and chat_template:
        writer.add_chat_template(vocab.chat_template)
    for i, (name, array) in enumerate(iter_tensors(src, hparams)):
        if name in skip:
            continue
        kind = (types or {}).get(name)
        if kind is None:
            if array.ndim == 1:
                kind = "F32"
            elif name in ("token_embd.weight", "output.weight"):
                kind = embedding_type
            else:
                kind = layer_type
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in K_QUANTS:
            data = k_blocks(kind, *array.shape, seed=seed + i)
        elif kind == "F32":
            data = array
        else:
            data = gguf.quants.quantize(array, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(out))[0]
