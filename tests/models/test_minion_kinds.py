"""Minions made from the target's own weights: the 'substitute' (re-quantized by
llama.cpp) and the 'self_draft' (its first layers), as profiles write them and as
the loader builds them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from minions_local.core.errors import ModelLoadError, ProfileError
from minions_local.core.protocols import GrowBudget
from minions_local.engine.loading import MinionSpec, _load_substitute, gguf_gpu_layers
from minions_local.profile import load_profile

PROFILE = """
[hardware]
device = "cpu"
device_memory_gb = 4
device_memory_gbps = 10
host_ram_gb = 2
disk_read_gbps = 1
host_to_device_gbps = 5
compute_tflops = {{ bfloat16 = 1.0 }}

[target]
path = "builtin:smollm2-135m-instruct"

[target.dims]
layers = 30
hidden = 576
intermediate = 1536
heads = 9
kv_heads = 3
vocab = 49152
tied_embeddings = true
{minions}
"""


def profile_with(tmp_path, minions: str):
    path = tmp_path / "p.toml"
    path.write_text(PROFILE.format(minions=minions))
    return load_profile(path)


def test_minions_of_the_target_default_to_its_path_dims_and_a_name(tmp_path):
    profile = profile_with(tmp_path, '[[minions]]\nkind = "substitute"\nquantization = "q2_k"\n'
                                     '[[minions]]\nkind = "self_draft"\nlayers = 6\n')
    substitute, draft = profile.minions
    assert substitute.path == draft.path == profile.target.path
    assert substitute.dims == profile.target.dims and substitute.backend == "llama_cpp"
    assert (substitute.name, draft.name, draft.backend) == ("q2_k", "self-draft-6", "transformers")
    from minions_local.planning.memory_plan import plan_memory

    plan = plan_memory(profile)  # --plan works before the model is converted
    assert plan.minion_dims["self-draft-6"].layers == 6
    assert plan.minion_bytes["q2_k"] < plan.minion_bytes["self-draft-6"] * 30 / 6


@pytest.mark.parametrize("minion,message", [
    ('kind = "substitute"', "needs quantization = one of q2_k, q3_k_s, q3_k_m"),
    ('kind = "hf"\npath = "x"\nquantization = "q3_k_m"', "is for 'substitute' minions"),
    ('kind = "self_draft"', "'layers' is set for a 'self_draft' minion, and only for one"),
    ('kind = "substitute"\nquantization = "q2_k"\nlayers = 3', "'layers' is set for a 'self_draft' minion"),
])
def test_profile_rules_for_minions_of_the_target(tmp_path, minion, message):
    with pytest.raises(ProfileError) as err:
        profile_with(tmp_path, "[[minions]]\n" + minion + "\n")
    assert message in str(err.value)


def test_an_unknown_builtin_model_is_named(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text(PROFILE.format(minions="").replace("builtin:smollm2-135m-instruct", "builtin:gpt-7"))
    with pytest.raises(ProfileError, match="unknown built-in model 'builtin:gpt-7'.*builtin:smollm2-135m-instruct"):
        load_profile(path)


def test_a_substitute_without_llama_cpp_says_how_to_get_it(tmp_path, monkeypatch):
    import minions_local.backends.gguf as gguf

    def missing():
        raise ModelLoadError("GGUF minions need llama-cpp-python (No module named 'llama_cpp'): run "
                             "scripts/build_llama_cpp_wheel.sh.")

    monkeypatch.setattr(gguf, "import_llama_cpp", missing)
    source = tmp_path / "target.gguf"
    source.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as err:
        _load_substitute(MinionSpec(str(source), kind="substitute", quantization="q3_k_m"), progress=None, device="cpu")
    text = str(err.value)
    assert "re-quantized by llama.cpp" in text and "bash scripts/setup.sh" in text and "--minion ngram" in text


def test_a_cuda_gguf_minion_offloads_every_layer_or_says_its_build_cannot(monkeypatch):
    import minions_local.backends.gguf as gguf

    class Build:
        gpu = False

        def llama_supports_gpu_offload(self):
            return self.gpu

    build = Build()
    monkeypatch.setattr(gguf, "import_llama_cpp", lambda: build)
    assert gguf_gpu_layers("cpu", "q3_k_m") == 0
    with pytest.raises(ModelLoadError, match=r"without GPU support.*GGML_CUDA=ON.*device = .cpu."):
        gguf_gpu_layers("cuda", "q3_k_m")
    build.gpu = True
    assert gguf_gpu_layers("cuda", "q3_k_m") >= 999


def test_a_substitute_needs_a_gguf_of_the_target(tmp_path):
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        _load_substitute(MinionSpec(str(tmp_path), kind="substitute", quantization="q3_k_m"), progress=None, device="cpu")


def test_self_draft_is_the_targets_first_layers_and_its_head(families):
    from minions_local.backends.self_draft import load_self_draft

    folder = families["llama"]["target"]
    draft = load_self_draft(folder, 2, dtype=torch.float32, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.model.layers = reference.model.layers[:2]
    reference.config.num_hidden_layers = 2
    prompt = [5, 17, 9, 30, 2, 44]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    draft.runner.reset()
    got = draft.runner.extend(prompt)[-1]
    assert torch.allclose(got, expected, atol=1e-4)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    target_storage = {p.untyped_storage().data_ptr() for p in target.parameters()}
    assert not target_storage & {p.untyped_storage().data_ptr() for p in draft.model.parameters()}
    tree = draft.grow(prompt, GrowBudget(max_nodes=6, max_depth=3, width=2, top_k=2))
    assert 3 <= len(tree) <= 6 and np.all(np.array(tree.parents) < np.arange(len(tree)))
    assert tree.tokens[0] == int(expected.argmax())  # the best child first


def test_self_draft_layers_must_leave_some_out(families):
    from minions_local.backends.self_draft import load_self_draft

    with pytest.raises(ModelLoadError, match="'layers' must be 1 to 2, got 3"):
        load_self_draft(families["llama"]["target"], 3, dtype=torch.float32, device="cpu")


@pytest.mark.realmodel
def test_the_substitute_is_made_once_and_remade_when_damaged(converted, tmp_path):
    pytest.importorskip("llama_cpp")
    from minions_local.backends.substitute import substitute_gguf
    from minions_local.models.smollm2 import shipped_gguf

    out = tmp_path / "sub.q2_k.gguf"
    records: list = []
    assert substitute_gguf(shipped_gguf(), "q2_k", out, progress=records.append) == out
    assert records and "re-quantizing the target to q2_k" in records[0].message
    size = out.stat().st_size
    assert 0 < size < shipped_gguf().stat().st_size  # fewer bits than the shipped Q4_1
    again: list = []
    substitute_gguf(shipped_gguf(), "q2_k", out, progress=again.append)
    assert not again  # made once
    with out.open("r+b") as f:
        f.seek(-64, 2)
        f.write(b"\0" * 64)
    substitute_gguf(shipped_gguf(), "q2_k", out, progress=again.append)
    assert again and out.stat().st_size == size
