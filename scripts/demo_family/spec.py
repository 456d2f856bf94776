"""Shapes and training budgets of the demo family, as data.

Budgets are in optimizer steps (tokens), never in wall-clock time, so a run is
deterministic for a seed no matter how busy the machine is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


@dataclass(frozen=True)
class ModelShape:
    """One member of the family: its folder name, architecture and dimensions."""

    name: str
    family: str  # key of ARCHITECTURES
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int = 2048

    def config(self, vocab_size: int, bos_id: int, eos_id: int) -> PretrainedConfig:
        config_cls, _ = ARCHITECTURES[self.family]
        extra: dict = {}
        if self.family == "mistral":
            extra["sliding_window"] = None  # full attention: the engine assumes it
        if self.family == "qwen2":
            extra["use_sliding_window"] = False
        return config_cls(
            vocab_size=vocab_size, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions, rope_theta=10000.0,
            tie_word_embeddings=True,  # halves the embedding bytes every pass streams
            bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id, **extra)

    def build(self, vocab_size: int, bos_id: int, eos_id: int) -> PreTrainedModel:
        _, model_cls = ARCHITECTURES[self.family]
        model = model_cls(self.config(vocab_size, bos_id, eos_id))
        model.config._attn_implementation = "sdpa"
        return model


@dataclass(frozen=True)
class Budget:
    """Optimizer steps of each phase; one step = batch_size sequences of seq_len tokens.

    Phase 1: the target alone (cross-entropy on the corpus).
    Phase 2: the target keeps training; minions distil from the logits its training
             forward already computed (free teacher signal from a moving teacher).
    Phase 3: the target is frozen; minions distil from its final logits.
    """

    target_alone_steps: int
    shared_steps: int
    minion_alone_steps: int
    batch_size: int
    seq_len: int
    target_lr: float
    minion_lr: float
    warmup_steps: int

    @property
    def target_steps(self) -> int:
        return self.target_alone_steps + self.shared_steps

    @property
    def minion_steps(self) -> int:
        return self.shared_steps + self.minion_alone_steps

    @property
    def total_steps(self) -> int:
        return self.target_steps + self.minion_alone_steps

    def scaled(self, factor: float) -> Budget:
        """The same recipe with every phase ``factor`` times as long (an idle or bigger
        machine can afford a better family); warmup stays as it is."""
        longer = lambda steps: max(1, round(steps * factor))  # noqa: E731
        return replace(self, target_alone_steps=longer(self.target_alone_steps), shared_steps=longer(self.shared_steps),
                       minion_alone_steps=longer(self.minion_alone_steps))


@dataclass(frozen=True)
class FamilySpec:
    vocab_size: int
    target: ModelShape
    minions: tuple[ModelShape, ...]
    budget: Budget
    max_train_files: int | None = None  # None = the whole stdlib
    eval_files_per_package: int = 4
    eval_window: int = 512
    eval_max_windows: int = 48
    greedy_prompts: int = 16
    greedy_prompt_len: int = 128
    greedy_new_tokens: int = 128
    size_limit_mb: float = 80.0
    min_target_params: int = field(default=20_000_000)
    minion_param_range: tuple[int, int] = (1_000_000, 8_000_000)


FULL = FamilySpec(
    vocab_size=4096,
    target=ModelShape("target", "llama", hidden=512, layers=6, heads=8, kv_heads=8, intermediate=1408),
    minions=(
        ModelShape("minion-llama-s", "llama", hidden=256, layers=3, heads=8, kv_heads=4, intermediate=704),
        ModelShape("minion-qwen2-xs", "qwen2", hidden=192, layers=2, heads=6, kv_heads=2, intermediate=512),
        ModelShape("minion-mistral-m", "mistral", hidden=320, layers=4, heads=10, kv_heads=2, intermediate=864),
    ),
    # Sized to finish within the hour on a 2-core box shared with other jobs (~300
    # target tokens/s when busy, ~1000 when idle); an idle box needs ~35 min.
    budget=Budget(target_alone_steps=300, shared_steps=300, minion_alone_steps=90, batch_size=2, seq_len=1024,
                  target_lr=2e-3, minion_lr=3e-3, warmup_steps=20),
)

QUICK = FamilySpec(
    vocab_size=512,
    target=ModelShape("target", "llama", hidden=64, layers=2, heads=2, kv_heads=2, intermediate=160, max_positions=256),
    minions=(
        ModelShape("minion-llama-s", "llama", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=256),
        ModelShape("minion-qwen2-xs", "qwen2", hidden=32, layers=2, heads=2, kv_heads=2, intermediate=64, max_positions=256),
        ModelShape("minion-mistral-m", "mistral", hidden=48, layers=1, heads=2, kv_heads=1, intermediate=96, max_positions=256),
    ),
    budget=Budget(target_alone_steps=6, shared_steps=4, minion_alone_steps=3, batch_size=2, seq_len=64,
                  target_lr=3e-3, minion_lr=3e-3, warmup_steps=2),
    max_train_files=60, eval_files_per_package=1, eval_window=64, eval_max_windows=4,
    greedy_prompts=2, greedy_prompt_len=16, greedy_new_tokens=16, min_target_params=0, minion_param_range=(0, 10**9),
)


def check_sizes(spec: FamilySpec, params: dict[str, int]) -> None:
    if params["target"] < spec.min_target_params:
        raise SystemExit(f"target has {params['target']:,} params, needs >= {spec.min_target_params:,}")
    lo, hi = spec.minion_param_range
    for name, n in params.items():
        if name != "target" and not lo <= n <= hi:
            raise SystemExit(f"{name} has {n:,} params, outside {lo:,}-{hi:,}")
