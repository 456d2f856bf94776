"""Which methods one benchmark run compares, built from a profile and model paths.

Each logical method comes as a list of candidates (threads 1 or 2; fp32 or bf16 for
transformers; f16 or q8_0 for llama.cpp); the benchmark's calibration keeps the
fastest candidate of each, or the first one when there is no calibration.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.methods import (EngineMethod, HFMethod, LlamaCppMethod, Method, engine_sharing_target, load_hf,
                                page_cache_dropper)
from minions_local import Engine
from minions_local.offload.dtypes import compute_dtype
from minions_local.speculation.budget import FixedBudget

HF_OFFLOAD_DIR = Path("~/.cache/minions-local/bench-hf-offload").expanduser()


@dataclass
class Lineup:
    target: Path
    minions: list[Path]
    profile: str
    tier: str
    threads: list[int]
    """Thread counts to try (the first is the default without calibration)."""
    hf_dtypes: list[str]
    gguf_types: list[str]
    fixed_budgets: list[int]
    chain_minions: list[Path]
    chain_depth: int = 8
    assisted_minions: list[Path] = field(default_factory=list)
    llama_cpp: bool = True
    n_ctx: int = 1024
    notes: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))

    def build(self) -> list[list[Method]]:
        """Candidates per logical method, the autoregressive baseline first."""
        adaptive_engine = Engine.from_profile(self.profile, target=str(self.target),
                                              minions=[str(p) for p in self.minions] + self._profile_ngram())
        groups: list[list[Method]] = []
        ar = engine_sharing_target(adaptive_engine, [], FixedBudget(nodes=0, depth=0))
        groups.append(self._threads(EngineMethod("autoregressive", "autoregressive", ar, 1, "engine, no minions")))
        groups += self._transformers()
        minions = adaptive_engine.minions
        for path in self.chain_minions:
            minion = next(m for m in minions if m.name == path.name)
            d = self.chain_depth
            engine = engine_sharing_target(adaptive_engine, [minion], FixedBudget(nodes=d, depth=d))
            groups.append(self._threads(EngineMethod(f"chain {path.name} d{d}", "chain", engine, 1, f"depth {d}")))
        depth = adaptive_engine.decoder.policy.max_depth if hasattr(adaptive_engine.decoder.policy, "max_depth") else 12
        for nodes in self.fixed_budgets:
            engine = engine_sharing_target(adaptive_engine, minions, FixedBudget(nodes=nodes, depth=depth))
            method = EngineMethod(f"fixed {nodes}", "fixed", engine, 1, f"depth<={depth}, all minions")
            groups.append(self._threads(method))
        groups.append(self._threads(EngineMethod("adaptive", "adaptive", adaptive_engine, 1,
                                                 type(adaptive_engine.decoder.policy).__name__)))
        groups += self._llama_cpp()
        return groups

    def _profile_ngram(self) -> list[str]:
        from minions_local.profile import load_profile

        return ["ngram"] if any(m.kind == "ngram" for m in load_profile(self.profile).minions) else []

    def _threads(self, method: Method) -> list[Method]:
        return [method.variant(threads=n) for n in self.threads]

    def _transformers(self) -> list[list[Method]]:
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(self.target).eos_token_id
        plain: list[Method] = []
        assisted: dict[Path, list[Method]] = {p: [] for p in self.assisted_minions}
        for name in self.hf_dtypes:
            dtype = compute_dtype(name)
            offload = HF_OFFLOAD_DIR / f"{self.target.name}-{name}" if self.tier == "disk" else None
            model = load_hf(self.target, dtype, offload_folder=offload)
            drop = page_cache_dropper(offload, self.target) if offload else None
            where = ", accelerate disk offload" if offload else ""
            plain += self._threads(HFMethod("hf greedy", model, 1, eos_id=eos, detail=f"{name}{where}",
                                            before_pass=drop))
            for path in self.assisted_minions:
                # The target's model object is shared: its page-cache dropper is already hooked.
                assistant = load_hf(path, dtype)
                assisted[path] += self._threads(HFMethod(f"hf assisted {path.name}", model, 1, assistant=assistant,
                                                         eos_id=eos, detail=f"{name}{where}, default schedule"))
        return [plain, *assisted.values()]

    def _llama_cpp(self) -> list[list[Method]]:
        if not self.llama_cpp:
            return []
        if self.tier == "disk":
            self.notes.append("llama.cpp skipped on the disk tier: it has no layer streaming (mmap reads the whole "
                              "model into the page cache), so it would run a RAM-tier target")
            return []
        try:
            import llama_cpp  # noqa: F401

            from minions_local.backends.gguf_export import export_gguf
        except ImportError as err:
            self.notes.append(f"llama.cpp skipped: {err}")
            return []
        plain: list[Method] = []
        lookup: list[Method] = []
        for kind in self.gguf_types:
            gguf = export_gguf(self.target, self.workdir / f"target-{kind}.gguf", type=kind)
            for n in self.threads:
                plain.append(LlamaCppMethod("llama.cpp", gguf, n, prompt_lookup=False, n_ctx=self.n_ctx, detail=kind))
                lookup.append(LlamaCppMethod("llama.cpp prompt-lookup", gguf, n, prompt_lookup=True, n_ctx=self.n_ctx,
                                             detail=f"{kind}, 2-gram, 10 tokens"))
        return [plain, lookup]
