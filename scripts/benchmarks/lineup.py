"""Which methods one benchmark run compares, built from a profile.

Each logical method comes as a list of candidates (threads 1 or 2; bf16 or fp32 for
our engine and transformers; the shipped Q4_1 GGUF or an f16 export for llama.cpp);
the benchmark's calibration keeps the fastest candidate of each, so every method
runs at its own best settings, tried in the same run.

Ours: autoregressive (no minions: the baseline), the profile's adaptive policy with
learned selection and with all minions running, and fixed tree sizes (for "adaptive
against the best fixed size in hindsight"); all of one dtype share one loaded target.
Peers: transformers plain, assisted by a truncated copy of the target (its first K
layers, norm and head) and by prompt lookup, with accelerate disk offload on the disk
tier; llama.cpp plain and with prompt lookup, in a memory group smaller than the
model on the disk tier. With `gguf_target`: our engine with the target's GGUF file as
the target (its quantized blocks streamed, offload/gguf_streamed.py), autoregressive
and adaptive, against today's stream of the same model.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.llama_child import LlamaCppServer
from benchmarks.methods import EngineMethod, HFMethod, LlamaCppMethod, Method, engine_sharing_target, load_hf, \
    page_cache_dropper, param_bytes
from minions_local import Engine
from minions_local.engine.from_profile import engine_kwargs_from_profile
from minions_local.engine.loading import prepare_builtin
from minions_local.offload.binding import uses_int4_kernel
from minions_local.offload.dtypes import compute_dtype, dtype_name
from minions_local.profile import load_profile
from minions_local.speculation.budget import FixedBudget

HF_OFFLOAD_DIR = Path("~/.cache/minions-local/bench-hf-offload").expanduser()
PROMPT_LOOKUP_TOKENS = 10
"""transformers' prompt lookup draft length (llama-cpp-python's default is 10 too)."""


def private_copy(folder: Path, dest: Path) -> Path:
    """A copy of a model folder no other process maps. accelerate offloads a safetensors
    checkpoint by reading the checkpoint's own file, and a page some process has mapped
    (the self-draft minion, the assistant, another program using the model) survives
    the page-cache drop before each pass: from a shared file its "disk" reads would come
    partly from RAM. Copied once; kept while the source's files keep their sizes."""
    files = [f for f in folder.iterdir() if f.is_file()]
    if dest.is_dir() and all((dest / f.name).is_file() and (dest / f.name).stat().st_size == f.stat().st_size
                             for f in files):
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, partial / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest


@dataclass
class Lineup:
    profile: str
    tier: str
    threads: list[int]
    """Thread counts to try (the first is the default without calibration)."""
    dtypes: list[str]
    """Compute dtypes to try for our engine and transformers."""
    gguf_types: list[str]
    """llama.cpp weights to try: 'q4_1' (the shipped GGUF, when the target is built from it), or an
    export of the target ('f32', 'f16', 'q8_0', 'q4_0')."""
    fixed_budgets: list[int]
    overrides: dict[str, Any] = field(default_factory=dict)
    """target= / minions= for Engine.from_profile (the stand-ins)."""
    transformers: bool = True
    llama_cpp: bool = True
    llama_memory_share: float = 0.5
    n_ctx: int = 1024
    warm_ids: list[int] = field(default_factory=list)
    """A prompt never measured (llama.cpp's children warm up on it, padded to n_ctx)."""
    gguf_target: bool = False
    """Also our engine with the target's GGUF as the target (the shipped Q4_1 file for the
    built-in SmolLM2, else a q8_0 export): autoregressive and adaptive."""
    private_packs: bool = False
    """Stream from layer packs in the run's own folder (stand-ins), not the profile's disk path."""
    notes: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))
    target: Path | None = None
    servers: list[LlamaCppServer] = field(default_factory=list)

    def tokenizer(self):
        """The target's tokenizer (a built-in target is converted here on first use)."""
        from minions_local.engine.text import load_tokenizer

        self.target = prepare_builtin(self._engine_kwargs(self.dtypes[0])["target"], None)
        return load_tokenizer(self.target, "target")

    def build(self) -> list[list[Method]]:
        """Candidates per logical method, the autoregressive baseline first."""
        ours = [self._ours(name) for name in self.dtypes]
        groups = [[m for per_dtype in ours for m in per_dtype[k]] for k in range(len(ours[0]))]
        if self.gguf_target:
            groups += self._gguf_target()
        if self.transformers:
            groups += self._transformers()
        if self.llama_cpp:
            groups += self._llama_cpp()
        return [g for g in groups if g]

    def close(self) -> None:
        for server in self.servers:
            server.close(self.notes)
        self.servers.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _threads(self, method: Method) -> list[Method]:
        return [method.variant(threads=n) for n in self.threads]

    def _engine_kwargs(self, dtype: str) -> dict[str, Any]:
        weights, compute = weights_and_math(dtype)
        kwargs = engine_kwargs_from_profile(self.profile, tier=self.tier, dtype=compute_dtype(weights),
                                            compute_dtype=compute, **self.overrides)
        if self.private_packs and kwargs.get("stream_options"):
            kwargs["stream_options"]["cache_dir"] = str(self.workdir / "packs")
        return kwargs

    def _ours(self, dtype: str) -> list[list[Method]]:
        """[autoregressive, adaptive, adaptive all-minions, fixed...] candidates of one dtype."""
        kwargs = self._engine_kwargs(dtype)
        base = Engine.from_pretrained(**kwargs)
        weights = param_bytes(base.decoder.target.model)
        policy = type(base.decoder.policy).__name__
        weights_name, _ = weights_and_math(dtype)
        math = base.decoder.target.model.dtype
        label = dtype if compute_dtype(weights_name) == math else f"{weights_name} weights, {dtype_name(math)} math"

        def method(name: str, family: str, engine: Engine, detail: str) -> list[Method]:
            return self._threads(EngineMethod(name, family, engine, 1, f"{label}, {detail}", dtype=dtype,
                                              weight_bytes=weights))

        minions = base.minions
        ar = engine_sharing_target(base, [], FixedBudget(nodes=0, depth=0))
        # The same policy, fresh (a policy learns as it runs): only the selection differs.
        every = engine_sharing_target(base, minions, self._fresh_policy(dtype), selection="all")
        groups = [method("autoregressive", "autoregressive", ar, "no minions"),
                  method("adaptive", "adaptive", base, f"{policy}, learned selection"),
                  method("adaptive all-minions", "adaptive-all", every, f"{policy}, every minion runs")]
        depth = getattr(base.decoder.policy, "max_depth", 12)
        for nodes in self.fixed_budgets:
            engine = engine_sharing_target(base, minions, FixedBudget(nodes=nodes, depth=depth))
            groups.append(method(f"fixed {nodes}", "fixed", engine, f"depth<={depth}, learned selection"))
        return groups

    def _gguf_target(self) -> list[list[Method]]:
        """[autoregressive, adaptive] with the GGUF as the target, the profile's minions
        (a substitute made from that file) and tier; its compute dtype as the loader
        picks, its 4-bit tensors through the int4 kernel where it applies ('auto'), and
        the same again dequantized into float32 ('dequant': the file's weights exactly)."""
        groups = []
        for kernel, name in (("auto", "gguf target"), ("dequant", "gguf dequant")):
            groups += self._gguf_engine(kernel, name)
        return groups

    def _gguf_engine(self, kernel: str, name: str) -> list[list[Method]]:
        path = self._gguf("q4_1") or self._gguf("q8_0")
        kwargs = engine_kwargs_from_profile(self.profile, tier=self.tier, **{**self.overrides, "target": str(path)})
        if kwargs.get("stream_options"):
            kwargs["stream_options"]["kernel"] = kernel
            if self.private_packs:
                kwargs["stream_options"]["cache_dir"] = str(self.workdir / "packs")
        base = Engine.from_pretrained(**kwargs)
        target = base.decoder.target
        math = dtype_name(target.model.dtype)
        stats = getattr(target, "stream_stats", None)
        read = f", {stats.bytes_per_pass / 1e6:.1f} MB a pass" if stats is not None else ""
        int4 = uses_int4_kernel(target.model)
        detail = f"{path.name} blocks{read}, {math} math" + (", int4 kernel" if int4 else ", dequantized")
        policy = type(base.decoder.policy).__name__

        def method(label: str, engine: Engine, what: str) -> list[Method]:
            return self._threads(EngineMethod(label, "gguf-target", engine, 1, f"{detail}, {what}", dtype=math,
                                              weight_bytes=stats.bytes_per_pass if stats else param_bytes(target.model)))

        ar = engine_sharing_target(base, [], FixedBudget(nodes=0, depth=0))
        return [method(f"{name} autoregressive", ar, "no minions"),
                method(f"{name} adaptive", base, f"{policy}, learned selection")]

    def _fresh_policy(self, dtype: str):
        """The profile's budget policy, built anew (it learns as it runs, so none is shared)."""
        return self._engine_kwargs(dtype)["budget"]

    def _assistant_layers(self) -> int:
        for minion in load_profile(self.profile).minions:
            if minion.kind == "self_draft" and minion.layers:
                return minion.layers
        from transformers import AutoConfig

        return max(1, AutoConfig.from_pretrained(self.target).num_hidden_layers // 4)

    def _transformers(self) -> list[list[Method]]:
        from transformers import AutoTokenizer

        assert self.target is not None, "build our engine first: it converts a built-in target"
        eos = AutoTokenizer.from_pretrained(self.target).eos_token_id
        k = self._assistant_layers()
        plain: list[Method] = []
        assisted: list[Method] = []
        lookup: list[Method] = []
        offload_root = self.workdir / "hf-offload" if self.private_packs else HF_OFFLOAD_DIR
        checkpoint = private_copy(self.target, offload_root / f"{self.target.name}-checkpoint") \
            if self.tier == "disk" else self.target
        device = load_profile(self.profile).hardware.device
        # On a GPU the RAM tier's peer is accelerate's CPU offload: layers in host RAM,
        # each copied to the GPU as it runs.
        layers_on = "disk" if self.tier == "disk" else "cpu" if device == "cuda" else None
        for name in dict.fromkeys(weights_and_math(d)[0] for d in self.dtypes):  # transformers: its own math
            dtype = compute_dtype(name)
            offload = offload_root / f"{self.target.name}-{name}" if self.tier == "disk" else None
            model = load_hf(checkpoint, dtype, offload_folder=offload, device=device, layers_on=layers_on)
            drop = page_cache_dropper(offload, checkpoint) if offload else None
            where = f", accelerate {layers_on} offload" if layers_on else ""
            plain += self._threads(HFMethod("hf", model, 1, eos_id=eos, detail=f"{name}{where}", dtype=name,
                                            before_pass=drop))
            # The target's model object is shared: its page-cache dropper is already hooked.
            assistant = load_hf(self.target, dtype, layers=k, device=device)
            assisted += self._threads(HFMethod(f"hf assisted first-{k}-layers", model, 1, assistant=assistant,
                                               eos_id=eos, dtype=name,
                                               detail=f"{name}{where}, the target's first {k} layers + norm + head"))
            lookup += self._threads(HFMethod("hf prompt-lookup", model, 1, prompt_lookup=PROMPT_LOOKUP_TOKENS,
                                             eos_id=eos, dtype=name,
                                             detail=f"{name}{where}, {PROMPT_LOOKUP_TOKENS} tokens"))
        if layers_on == "cpu":
            self.notes.append("transformers: decoder layers in host RAM, moved to the GPU layer by layer by "
                              "accelerate (device_map 'cpu'); embeddings, norm, head and the assistant on the GPU")
        if self.tier == "disk":
            self.notes.append(f"transformers: decoder layers offloaded to disk by accelerate, from a private copy "
                              f"of the checkpoint (offload folders under {offload_root}); their page cache is "
                              f"dropped before every pass")
        return [plain, assisted, lookup]

    def _gguf(self, kind: str) -> Path | None:
        from minions_local.models.builtin import SMOLLM2, builtin_name

        if kind == "q4_1":
            if builtin_name(self.target) != SMOLLM2:
                return None
            from minions_local.models.smollm2 import shipped_gguf

            return shipped_gguf()
        from minions_local.backends.gguf_export import export_gguf

        return export_gguf(self.target, self.workdir / f"target-{kind}.gguf", type=kind)

    def _llama_cpp(self) -> list[list[Method]]:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as err:
            self.notes.append(f"llama.cpp skipped: {err} (scripts/setup.sh installs llama-cpp-python)")
            return []
        plain: list[Method] = []
        lookup: list[Method] = []
        share = self.llama_memory_share if self.tier == "disk" else None
        warm = (self.warm_ids * (self.n_ctx // max(1, len(self.warm_ids)) + 1))[: self.n_ctx - 16]
        for kind in self.gguf_types:
            try:
                gguf = self._gguf(kind)
            except Exception as err:  # noqa: BLE001 - an export the tokenizer or llama.cpp refuses: skip it
                self.notes.append(f"llama.cpp {kind} skipped: exporting the target failed: {err}")
                continue
            if gguf is None:
                continue
            server = LlamaCppServer(gguf, threads=self.threads, n_ctx=self.n_ctx, warm_ids=warm,
                                    memory_share=share, tag=kind, notes=self.notes)
            self.servers.append(server)
            source = "shipped" if kind == "q4_1" else "exported"
            for n in self.threads:
                plain.append(LlamaCppMethod("llama.cpp", server, n, prompt_lookup=False, dtype=kind,
                                            detail=f"{kind} ({source})"))
                lookup.append(LlamaCppMethod("llama.cpp prompt-lookup", server, n, prompt_lookup=True, dtype=kind,
                                             detail=f"{kind} ({source}), 2-gram, 10 tokens"))
        return [plain, lookup]


def weights_and_math(candidate: str) -> tuple[str, str]:
    """A dtype candidate as (weights, math): 'bf16' is bf16 weights computed as the engine
    decides ('auto'); 'bf16:bf16' forces bf16 math, 'bf16:fp32' float32 math."""
    weights, _, math = candidate.partition(":")
    return weights, math or "auto"
