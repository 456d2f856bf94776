"""Writing the trained demo family to disk: bf16 HF folders, manifest, model card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from minions_local.models.checksum import sha256_of
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

MANIFEST = "manifest.json"
MODEL_CARD = "MODEL_CARD.md"


def save_member(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """One self-contained HF folder: config, bf16 safetensors, generation config, tokenizer."""
    if folder.exists():
        shutil.rmtree(folder)
    shipped = model.to(torch.bfloat16)
    shipped.config.dtype = torch.bfloat16
    shipped.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    shipped.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    make_tokenizer_config_portable(folder, tokenizer.chat_template)


def make_tokenizer_config_portable(folder: Path, chat_template: str) -> None:
    """transformers 5 writes the template to chat_template.jinja and names its own
    backend class; older readers (transformers 4, GGUF converters) look for the
    template and a ``PreTrainedTokenizerFast`` class in tokenizer_config.json."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def check_reloads(folder: Path, reference: PreTrainedModel, sample: torch.Tensor) -> float:
    """Reload offline as a user would; returns the max |logit| difference to ``reference``
    (the in-memory bf16-rounded model), raising if the folder is not loadable."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.eos_token_id is None or not tokenizer.chat_template:
        raise RuntimeError(f"{folder}: tokenizer lost its EOS token or chat template")
    with torch.no_grad():
        got = model(input_ids=sample[None]).logits
        want = reference(input_ids=sample[None]).logits
    return float((got - want).abs().max())


def write_manifest(out: Path) -> dict:
    """sha256 and size of every shipped file, so a loader can name a damaged one."""
    files = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(out).as_posix()] = {"sha256": sha256_of(path), "size": path.stat().st_size}
    manifest = {
        "format": 1,
        "recreate": "python scripts/train_demo_family.py --seed 0",
        "total_bytes": sum(f["size"] for f in files.values()),
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def total_mb(out: Path) -> float:
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6


def write_model_card(out: Path, figures: dict, recipe: dict, command: str) -> None:
    rows = []
    for name, fig in figures["models"].items():
        shape = recipe["shapes"][name]
        agree = fig.get("third_party", {})
        rows.append(
            f"| `{name}` | {shape['architecture']} | {shape['layers']} x {shape['hidden']} "
            f"| {fig['params'] / 1e6:.2f}M | {fig['held_out_loss']:.3f} "
            f"| {_pct(agree.get('top1'))} | {_pct(agree.get('top4'))} | {_num(agree.get('mean_run'))} "
            f"| {_num(fig.get('greedy', {}).get('chain_tokens_per_pass'))} |"
        )
    card = f"""# minions-local demo model family

A small, self-made model family so minions-local runs offline out of the box: one
**target** (Llama) and three heterogeneous **minions** (draft models: Llama, Qwen2,
Mistral architectures) sharing one tokenizer. Nothing here came from a model hub.

## Corpus
The Python standard library of the machine that trained it (CPython
{recipe['python_version']}, found through `sysconfig.get_paths()["stdlib"]`): library
`.py` source plus the reference docs in `pydoc_data/topics.py`. Test directories,
`site-packages` and `dist-packages` are excluded; one library file in
{recipe['held_out_modulus']} (by path hash) is held out. A tenth of source files and all
docs topics appear in the chat format below. {recipe['train_tokens']:,} training tokens,
{recipe['held_out_tokens']:,} held-out tokens.
The corpus is the Python standard library, © Python Software Foundation, under the
**PSF License** (PSF-2.0); these weights are trained on it.

## Tokenizer
GPT-2 style byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer with the GPT-2
regex, no normalizer), vocabulary {recipe['vocab_size']}. `<|endoftext|>` is BOS, EOS and PAD.
Chat template: plain-text role markers,

```
<|endoftext|>### User:
{{message}}

### Assistant:
{{reply}}<|endoftext|>
```

## Recipe
- Target: cross-entropy on the corpus, {recipe['budget']['target_steps']} steps.
- Minions: forward KL to the target's next-token distribution on the same corpus
  windows: {recipe['budget']['shared_steps']} steps while the target finishes training (its
  training forward is the teacher signal), then {recipe['budget']['minion_alone_steps']} steps on the frozen final target.
- Each step: {recipe['budget']['batch_size']} windows of {recipe['budget']['seq_len']} tokens; AdamW (0.9, 0.95), weight
  decay 0.1, cosine schedule, peak lr {recipe['budget']['target_lr']} (target) / {recipe['budget']['minion_lr']} (minions), grad clip 1.0,
  bf16 autocast on CPU. Seed {recipe['seed']}; budgets are step counts, so the run is deterministic.
- Wall time of this run: {recipe['wall_minutes']:.1f} min on {recipe['machine']}.
- Saved as bf16 safetensors; every folder is a complete HF folder (tokenizer included).

## Figures
Held-out loss: nats/token on the held-out stdlib slice. Agreement: on a fixed sample of
third-party library code from site-packages ({recipe['third_party_packages']}), never
trained on; `top1` = minion's greedy token is the target's, `top4` = the target's token
is in the minion's top 4, `run` = expected accepted length of a depth-8 greedy chain
starting anywhere. `tokens/pass` = simulated greedy speculative decoding with a depth-8
chain of that minion, on the target's own greedy continuation of third-party code
(target's bonus token included).

| model | arch | layers x width | params | held-out loss | top1 | top4 | run | tokens/pass |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

All three minions' chains together as one tree: {_num(figures['tree_of_chains_tokens_per_pass'])} tokens
per target pass on the target's greedy continuations ({_num(figures['tree_of_chains_tokens_per_pass_real_code'])} along real third-party code).

## Limitations
These are toys sized to train in well under an hour on a busy 2-core CPU: they write
Python-flavoured text, not answers, and greedy decoding soon falls into repetition
loops. Loops are easy to predict, so the greedy `tokens/pass` figures flatter the
minions; the agreement columns, measured along real third-party code, are the honest
measure. A better family: add `--steps-scale 3` (about three times the wall time).

## Re-create
```
{command}
```
`manifest.json` lists each file's sha256 and size; a damaged or missing file can be
restored by reinstalling the package or re-running the command above.
"""
    (out / MODEL_CARD).write_text(card)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"
