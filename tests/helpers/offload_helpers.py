"""Tiny random causal LMs and a token-tree forward for the offload tests (no downloads)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig, Qwen2Config

from minions_local.backends.hf import cache_kwargs

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
VOCAB = 128


@contextlib.contextmanager
def one_thread():
    """Tiny models gain nothing from 2 threads and lose a lot when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def save_tiny(root: Path, arch: str = "llama", *, layers: int = 4, tie: bool = False, seed: int = 0) -> Path:
    """A random model of `arch`, saved as safetensors under root/arch."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tie)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](**kwargs), dtype=torch.float32)
    path = root / f"{arch}{'-tied' if tie else ''}-{layers}"
    model.save_pretrained(path, safe_serialization=True)
    return path


def resident(path: Path, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


# A tree below the root (node 0): two branches, depth 3.
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def tree_mask(parents: list[int], prefix: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask (1, 1, T, P+T): each node sees the prefix, its ancestors and itself."""
    t = len(parents)
    mask = torch.full((1, 1, t, prefix + t), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :prefix] = 0
    for i in range(t):
        j = i
        while j >= 0:
            mask[0, 0, i, prefix + j] = 0
            j = parents[j]
    return mask


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


@torch.inference_mode()
def tree_pass_logits(model, *, prompt_len: int = 9, steps: int = 2, seed: int = 1) -> list[torch.Tensor]:
    """Prefill a prompt, then verify a token tree `steps` times on the same cache,
    keeping one branch's entries in between (what the engine does)."""
    gen = torch.Generator().manual_seed(seed)
    first = next(model.parameters())
    dtype, dev = first.dtype, first.device
    cache = DynamicCache()
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=gen).to(dev)
    outs = [model(input_ids=prompt, **cache_kwargs(model, cache), use_cache=True).logits.cpu()]
    for _ in range(steps):
        p = cache.get_seq_length()
        tokens = torch.randint(0, VOCAB, (1, len(PARENTS)), generator=gen).to(dev)
        pos = torch.tensor([[p + d for d in depths(PARENTS)]], device=dev)
        out = model(input_ids=tokens, attention_mask=tree_mask(PARENTS, p, dtype).to(dev), position_ids=pos,
                    **cache_kwargs(model, cache), use_cache=True)
        outs.append(out.logits.cpu())
        keep = torch.tensor(list(range(p)) + [p, p + 1, p + 3], device=dev)  # root -> 1 -> 3
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)
    return outs


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


def cached_pages(path: Path, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages in the file), via mincore(2); of the
    whole pages in bytes [start, end) when given."""
    import ctypes
    import mmap
    import os

    size = path.stat().st_size
    page = mmap.PAGESIZE
    n = (size + page - 1) // page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = ctypes.create_string_buffer(n)
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    first, last = -(-start // page), (size if end is None else end) // page
    if end is None or end >= size:
        last = n
    return sum(b & 1 for b in vec.raw[first:last]), max(0, last - first)


def device_readahead_bytes(path: Path) -> int:
    """The readahead of the block device holding `path` (its queue's read_ahead_kb): how far
    past a read, or around a page fault, the kernel may bring a file's pages in. 128 KB, the
    kernel's default, where sysfs does not say (an overlay, tmpfs)."""
    import os

    st = os.stat(path)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for queue in (node / "queue", node.resolve().parent / "queue"):  # a disk, or a partition's disk
        try:
            return int((queue / "read_ahead_kb").read_text()) * 1024
        except (OSError, ValueError):
            continue
    return 128 * 1024
