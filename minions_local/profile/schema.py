"""The hardware profile: what the machine is and which models run where, as data.

A profile is a TOML file validated by these models. Every field says what it means
(the descriptions are the reference documentation: `python -m minions_local.planning
--schema` prints them). Unknown keys are errors, so a misspelt field never silently
falls back to a default.

Units: memory in GB (1e9 bytes), bandwidth in GB/s, compute in TFLOP/s, times in ms.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from minions_local.core.tiers import Tier
from minions_local.profile.gguf_sizes import GGUFMix

DType = Literal["float32", "bfloat16", "float16"]
TargetQuantization = Literal["none", "int8", "int4"]
MinionQuantization = Literal["none", "nf4", "int8", "q2_k", "q3_k_s", "q3_k_m"]
LLAMA_CPP_QUANTIZATIONS = ("q2_k", "q3_k_s", "q3_k_m")
"""What llama.cpp re-quantizes a 'substitute' minion to: 3 bits or fewer per weight."""
MinionKind = Literal["hf", "gguf", "ngram", "substitute", "self_draft", "eagle"]
_ENDPOINT = re.compile(r"[A-Za-z0-9._-]+:\d{1,5}")
"""An RPC server as ggml's client reads it (backends/llama_rpc.parse_endpoint checks the port)."""
OF_THE_TARGET = ("substitute", "self_draft")
"""Minion kinds made from the target's own weights (their path defaults to the target's)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KnownDims(_Section):
    """Dimensions of a model that may not be on this machine (for `--plan`)."""

    layers: int = Field(gt=0, description="Decoder layers (num_hidden_layers).")
    hidden: int = Field(gt=0, description="Hidden size (hidden_size).")
    intermediate: int = Field(gt=0, description="MLP inner size (intermediate_size).")
    heads: int = Field(gt=0, description="Attention heads (num_attention_heads).")
    kv_heads: int = Field(gt=0, description="Key/value heads (num_key_value_heads).")
    vocab: int = Field(gt=0, description="Vocabulary size (vocab_size).")
    head_dim: int | None = Field(None, gt=0, description="Per-head size; hidden // heads when absent.")
    tied_embeddings: bool = Field(False, description="Output head shares the input embeddings.")
    params: float | None = Field(
        None, gt=0, description="Published parameter count, for display and as a cross-check."
    )


class Hardware(_Section):
    """The machine: memory budgets and measured speeds of its links and compute."""

    device: Literal["cpu", "cuda"] = Field(description="Compute device kind.")
    device_name: str = Field("", description="Human name of the device, e.g. 'NVIDIA RTX 4090'.")
    device_memory_gb: float = Field(
        gt=0,
        description="Memory the app may use on the compute device (VRAM; on a CPU box, the "
        "RAM for resident weights, minions and KV caches).",
    )
    device_reserve_gb: float = Field(
        0.0,
        ge=0,
        description="Device memory kept free for the CUDA context, activations and "
        "allocator slack; subtracted from device_memory_gb.",
    )
    device_memory_gbps: float = Field(
        gt=0,
        description="Bandwidth of the device's own memory (VRAM or RAM). Reading every "
        "weight once bounds a forward pass of few tokens from below.",
    )
    host_ram_gb: float = Field(
        ge=0,
        description="Host RAM for target layers streamed from RAM (pinned on CUDA). "
        "0 = no RAM tier: layers that are not resident stream from disk.",
    )
    disk_path: str = Field(
        "~/.cache/minions-local/offload",
        description="Folder for layers streamed from disk (repacked at the streamed quantization).",
    )
    disk_budget_gb: float = Field(0.0, ge=0, description="Space the disk tier may use under disk_path.")
    disk_read_gbps: float = Field(
        gt=0, description="Sequential read speed of disk_path with the page cache bypassed."
    )
    host_to_device_gbps: float = Field(
        gt=0,
        description="Copy speed from host RAM into device memory (pinned memory on CUDA; "
        "a memcpy on a CPU box).",
    )
    host_to_device_pageable_gbps: float | None = Field(
        None, gt=0, description="Copy speed from pageable (unpinned) RAM, when measured."
    )
    compute_tflops: dict[str, float] = Field(
        description="Achieved matmul throughput on large matrices by dtype, e.g. "
        "{bfloat16 = 150.0, float32 = 40.0}."
    )
    layer_overhead_ms: float = Field(
        0.1,
        ge=0,
        description="Fixed cost per decoder layer per forward (kernel launches, Python, "
        "synchronisation): what makes a tiny model's pass cost more than its flops.",
    )

    @model_validator(mode="after")
    def _reserve_fits(self) -> "Hardware":
        if self.device_reserve_gb >= self.device_memory_gb:
            raise ValueError(
                f"device_reserve_gb ({self.device_reserve_gb}) must be below "
                f"device_memory_gb ({self.device_memory_gb})"
            )
        if not self.compute_tflops:
            raise ValueError("compute_tflops needs at least one dtype, e.g. {bfloat16 = 1.0}")
        return self

    def tflops(self, dtype: str) -> float:
        """Throughput for `dtype`, falling back to the fastest measured one."""
        return self.compute_tflops.get(dtype) or max(self.compute_tflops.values())


class TargetSection(_Section):
    """The big model whose layers stream in for every verification pass."""

    path: str = Field(
        description="Model folder or file: 'builtin:NAME' (a model made on first use from an "
        "installed package, e.g. builtin:smollm2-135m-instruct), 'demo:NAME' (shipped demo model), "
        "'models:NAME' (under $MINIONS_MODELS_DIR, default ~/models), '~/...', an absolute path, or "
        "a path relative to the profile file. load_profile() resolves it to an absolute path."
    )
    format: Literal["hf", "gguf"] = Field(
        "hf", description="HF folder (safetensors) or GGUF file; a path ending in .gguf makes it 'gguf'. A "
        "GGUF target streams its layers as the file's own quantized blocks, dequantized as each layer runs "
        "(its streamed and resident quantization stay 'none'; dtype is what it computes in).")
    gguf_mix: GGUFMix | None = Field(
        None, description="For a GGUF target whose file is not on this machine (planning with --plan "
        "elsewhere): the llama.cpp quantization it was made with, which sizes its layers. When the file "
        "is here, its own tensor sizes are used.")
    gguf_kernel: Literal["auto", "llama.cpp", "int4", "dequant"] = Field(
        "auto", description="What multiplies a GGUF target's weights. 'llama.cpp': llama.cpp itself, ggml's "
        "quantized kernels on the file's own blocks (every architecture and type llama.cpp loads; CPU); "
        "'int4': torch's packed int4 CPU kernel on streamed 4-bit tensors (Q4_0, Q4_1, Q4_K; scales and "
        "each matmul's input rounded to bfloat16: a slightly different, still fixed model); 'dequant': "
        "torch, the weights dequantized into float32 as each layer runs; 'auto': llama.cpp on a CPU where "
        "llama-cpp-python is installed, else int4 where every layer matrix is 4-bit, else dequant.")
    dtype: DType = Field("bfloat16", description="Dtype of the target's weights: what its layers are "
                         "stored and streamed in, and computed in unless compute_dtype says otherwise.")
    compute_dtype: DType | Literal["auto"] = Field(
        "auto", description="What the target computes in. 'auto': dtype, except a streamed bfloat16 "
        "target on a CPU without bf16 matmul kernels (AVX2 only), which computes in float32 (its layers "
        "still stream as bf16): there a bf16 pass costs about as many 1-token passes as it has rows.")
    tier: Tier = Field(
        "ram",
        description="Lowest tier the target's layers may live on: 'device' = fully resident, "
        "'ram' = the rest stream from host RAM, 'disk' = RAM first, then disk.",
    )
    resident_quantization: TargetQuantization = Field(
        "none", description="Storage of the layers kept on the compute device."
    )
    streamed_quantization: TargetQuantization = Field(
        "none", description="Storage of the layers streamed in each pass (fewer bytes per pass)."
    )
    resident_layers: int | None = Field(
        None,
        ge=0,
        description="At most this many layers stay on the device; unset = as many as fit, "
        "0 = stream every layer.",
    )
    layer_buffers: int = Field(
        2, ge=1, le=8, description="Device buffers for streamed layers (1 = no overlap)."
    )
    context_tokens: int = Field(
        4096, ge=16, description="Tokens of KV cache reserved for the target and each minion."
    )
    dims: KnownDims | None = Field(
        None, description="Known dimensions, used when the model's config.json is absent."
    )
    rpc: list[str] = Field(
        default_factory=list, description="RPC servers ('host:port', each running minions-rpc-server) that hold "
        "some of a GGUF target's layers, computed there by llama.cpp: a model larger than this machine, pooled "
        "over several. Nothing streams from disk then; the minions stay here.")
    rpc_split: list[float] | None = Field(
        None, description="This machine's share of the layers, then each rpc server's (any scale, e.g. "
        "[0, 1, 1]); unset: in proportion to the memory each reports, as llama.cpp's tensor_split does.")
    rpc_timeout_s: float = Field(
        120.0, gt=0, description="Seconds an rpc server may stay silent while it owes an answer (it computes its "
        "layers of a pass meanwhile) before it counts as lost.")

    @model_validator(mode="before")
    @classmethod
    def _gguf_by_suffix(cls, data):
        if isinstance(data, dict) and "format" not in data and str(data.get("path", "")).lower().endswith(".gguf"):
            data = {**data, "format": "gguf"}
        return data

    @model_validator(mode="after")
    def _gguf_streams_its_own_blocks(self) -> "TargetSection":
        if self.format == "gguf" and (self.streamed_quantization, self.resident_quantization) != ("none", "none"):
            raise ValueError("a GGUF target streams the file's own quantized blocks: leave streamed_quantization "
                             "and resident_quantization at 'none' (re-quantize the file with llama-quantize "
                             "for fewer bytes a pass)")
        if self.gguf_mix is not None and self.format != "gguf":
            raise ValueError("gguf_mix describes a GGUF target; this target's format is 'hf'")
        if self.rpc and (self.format != "gguf" or self.gguf_kernel not in ("auto", "llama.cpp")):
            raise ValueError("rpc splits a GGUF target computed by llama.cpp: format 'gguf', gguf_kernel 'auto' "
                             "or 'llama.cpp'")
        for server in self.rpc:
            if not _ENDPOINT.fullmatch(server.strip()):
                raise ValueError(f"rpc server {server!r} is not host:port (an IPv4 address or a name; "
                                 f"ggml's client cannot take IPv6)")
        if self.rpc_split is not None and (len(self.rpc_split) != len(self.rpc) + 1 or min(self.rpc_split) < 0
                                           or not any(x > 0 for x in self.rpc_split[1:])):
            raise ValueError(f"rpc_split needs {len(self.rpc) + 1} shares >= 0 (this machine, then each rpc "
                             f"server), some server's above 0; got {self.rpc_split}")
        return self


class MinionSection(_Section):
    """A small draft model (or the n-gram heuristic) that stays resident."""

    name: str | None = Field(None, description="Display name; defaults to the folder name or kind.")
    kind: MinionKind = Field(
        "hf",
        description="What the minion is: 'hf' (a model folder), 'gguf' (a .gguf file run by llama.cpp), "
        "'ngram' (continuations seen earlier in the conversation), 'substitute' (the target's own "
        "weights re-quantized by llama.cpp to `quantization`), 'self_draft' (the target's first "
        "`layers` layers with its final norm and head), 'eagle' (a one-layer feature drafter that reads "
        "the target's own hidden states; scripts/train_drafter.py trains one for builtin:smollm2-135m-instruct).",
    )
    path: str | None = Field(
        None,
        description="Model folder/file, same forms as target.path; none for 'ngram'. A 'substitute' "
        "or 'self_draft' defaults to the target's path (a substitute needs a GGUF of the target: "
        "builtin:smollm2-135m-instruct has one). An 'eagle' minion's path is its weights file "
        "(scripts/train_drafter.py writes one); for the built-in target it defaults to the one that "
        "script trains into the user cache.",
    )
    backend: Literal["transformers", "llama_cpp", "ngram"] | None = Field(
        None, description="Runtime; defaults by kind (hf, self_draft: transformers; gguf, substitute: llama_cpp)."
    )
    quantization: MinionQuantization = Field(
        "none",
        description="Weight storage: bitsandbytes nf4/int8 for 'hf' (pays off on CUDA only); "
        "llama.cpp q2_k / q3_k_s / q3_k_m for a 'substitute' (made once, cached).",
    )
    layers: int | None = Field(
        None, ge=1, description="How many of the target's first layers a 'self_draft' runs."
    )
    device: Literal["cpu", "cuda"] | None = Field(
        None, description="Where it runs; defaults to hardware.device."
    )
    dtype: DType = Field("bfloat16", description="Compute dtype.")
    dims: KnownDims | None = Field(
        None, description="Known dimensions, used when the model's config.json is absent."
    )

    @model_validator(mode="after")
    def _path_matches_kind(self) -> "MinionSection":
        if self.kind == "ngram":
            if self.path is not None:
                raise ValueError("an 'ngram' minion has no path")
        elif not self.path and self.kind not in OF_THE_TARGET + ("eagle",):
            raise ValueError(f"a '{self.kind}' minion needs a path")
        llama_cpp_type = self.quantization in LLAMA_CPP_QUANTIZATIONS
        if self.kind == "substitute" and not llama_cpp_type:
            raise ValueError(f"a 'substitute' minion needs quantization = one of {', '.join(LLAMA_CPP_QUANTIZATIONS)}")
        if self.kind != "substitute" and llama_cpp_type:
            raise ValueError(f"quantization '{self.quantization}' is for 'substitute' minions (llama.cpp "
                             f"re-quantizes the target); a '{self.kind}' minion takes none, nf4 or int8")
        if (self.kind == "self_draft") != (self.layers is not None):
            raise ValueError("'layers' is set for a 'self_draft' minion, and only for one")
        if self.backend is None:
            default = {"hf": "transformers", "gguf": "llama_cpp", "ngram": "ngram", "substitute": "llama_cpp",
                       "self_draft": "transformers", "eagle": "transformers"}[self.kind]
            object.__setattr__(self, "backend", default)
        if self.name is None:
            object.__setattr__(self, "name", self._default_name())
        return self

    def _default_name(self) -> str:
        if self.kind == "substitute":
            return self.quantization
        if self.kind == "self_draft":
            return f"self-draft-{self.layers}"
        if self.kind == "eagle":
            return "eagle"
        stem = self.path.rstrip("/").rsplit("/", 1)[-1].split(":")[-1] if self.path else "ngram"
        return stem.removesuffix(".gguf")


class Speculation(_Section):
    """Limits for the token tree the minions grow and the target verifies."""

    adaptive: bool = Field(True, description="Let the cost model pick the budget each step.")
    budget: int = Field(32, ge=0, description="Draft nodes per step when adaptive is off.")
    min_budget: int = Field(1, ge=0, description="Smallest tree the adaptive budget may pick; 0 lets it decode "
                                                 "without a tree while none pays (one step in 16 still probes).")
    max_budget: int = Field(256, ge=1, description="Largest tree the adaptive budget may pick.")
    max_depth: int = Field(16, ge=1, description="Tree levels below the root at most.")
    width: int = Field(8, ge=1, description="Nodes each minion adds per forward pass while growing.")
    top_k: int = Field(8, ge=1, description="Children considered per expanded node.")
    grow_ahead: bool | Literal["auto"] = Field(
        "auto", description="Let minions keep growing while the target verifies (a head start for the next "
                            "tree); auto: where the target's pass leaves them compute of their own.")

    @model_validator(mode="after")
    def _ordered(self) -> "Speculation":
        if self.min_budget > self.max_budget:
            raise ValueError(f"min_budget ({self.min_budget}) > max_budget ({self.max_budget})")
        if not self.adaptive and not self.min_budget <= self.budget <= self.max_budget:
            raise ValueError(
                f"budget ({self.budget}) must lie in [min_budget, max_budget] = "
                f"[{self.min_budget}, {self.max_budget}]"
            )
        return self


class MatmulSample(_Section):
    dtype: str = Field(description="Matrix dtype.")
    size: int = Field(gt=0, description="Square matrix side n (an n x n @ n x n product).")
    tflops: float = Field(ge=0, description="Achieved TFLOP/s.")


class TimingSample(_Section):
    model: str = Field(description="'target' or a minion's name.")
    tokens: int = Field(ge=1, description="Tokens per forward (tree width for a minion).")
    seconds: float = Field(ge=0, description="Seconds per forward (per layer for the target).")


class Measurements(_Section):
    """What autotune measured, kept for the cost model and for the record."""

    tool: str = Field("", description="What produced these numbers (script and version).")
    when: str = Field("", description="UTC timestamp of the measurement.")
    disk_read_cached_gbps: float | None = Field(None, description="Disk read from the page cache.")
    matmul: list[MatmulSample] = Field(default_factory=list, description="Throughput by size/dtype.")
    grow: list[TimingSample] = Field(
        default_factory=list, description="Minion forward time by tree width."
    )
    target_layer: list[TimingSample] = Field(
        default_factory=list, description="Target seconds per decoder layer by tokens."
    )


class Profile(_Section):
    """A machine plus the models it runs, as loaded from one TOML file."""

    name: str = Field(description="Short name (the file's stem for shipped profiles).")
    description: str = Field("", description="One line shown in the profile picker.")
    hardware: Hardware = Field(description="The machine.")
    target: TargetSection = Field(description="The big model.")
    minions: list[MinionSection] = Field(default_factory=list, description="The draft models.")
    speculation: Speculation = Field(default_factory=Speculation, description="Tree limits.")
    measurements: Measurements | None = Field(None, description="Autotune's raw measurements.")

    _source: str | None = PrivateAttr(None)

    @property
    def source(self) -> str | None:
        """The file this profile was read from."""
        return self._source

    @model_validator(mode="after")
    def _unique_minion_names(self) -> "Profile":
        seen: set[str] = set()
        for m in self.minions:
            if m.name in seen:
                raise ValueError(f"two minions are named '{m.name}': give one a 'name'")
            seen.add(m.name)
        return self
