"""A GGUF target named on the command line of a CPU profile (planning/fitting.py): its
budget is this machine's free memory, its minions are a small model on its vocabulary
found beside it (or named), plus n-gram, and --plan says what was chosen and why; bad
files and memory too small get messages that name the file and what to do."""

from __future__ import annotations

import pytest

from minions_local.core.errors import MemoryPlanError, MinionsError, VocabularyMismatchError
from minions_local.planning import fitting
from minions_local.planning.fitting import load_fitted
from minions_local.planning.machine_memory import MachineMemory
from minions_local.planning.memory_plan import gguf_on_llama_cpp
from minions_local.planning.report import plan_report

pytest.importorskip("gguf")

PLENTY = MachineMemory(8_000_000_000, "MemAvailable 8.5 GB", 500_000_000)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """A 10 MB target (8 layers, F16) with, beside it: a 0.1 MB minion and an HF folder on
    its vocabulary, a minion on another vocabulary, and a copy of the target too large to
    be a minion."""
    from tests.helpers.tiny_gguf import write_gguf
    from tests.helpers.tiny_models import random_model, save, tiny_config, tiny_tokenizer

    root = tmp_path_factory.mktemp("fitting")
    big = save(random_model(tiny_config("llama", hidden=256, layers=8, ctx=2048), seed=1), root / "src-big", tokenizer)
    small = save(random_model(tiny_config("llama", hidden=64, layers=1), seed=2), root / "src-small", tokenizer)
    other = save(random_model(tiny_config("llama", hidden=64, layers=1), seed=3), root / "src-other",
                 tiny_tokenizer(vocab=48))
    models = root / "models"
    models.mkdir()
    out = {"target": write_gguf(big, models / "target.Q4_K.gguf", "Q4_K", embedding_type="F16"),
           "twin": write_gguf(big, models / "twin.gguf", "F16"),
           "small": write_gguf(small, models / "small.Q8_0.gguf", "Q8_0"),
           "other": write_gguf(other, models / "other.Q8_0.gguf", "Q8_0"),
           "folder": save(random_model(tiny_config("llama", hidden=64, layers=1), seed=4), root / "alone" / "hf",
                          tokenizer)}
    out["alone"] = write_gguf(big, root / "alone" / "target.gguf", "Q4_K", embedding_type="F16")
    return out


def test_budgets_come_from_the_machine_and_layers_past_it_stream_from_the_file(models):
    target = models["target"]
    fitted = load_fitted("cpu-demo", target=str(target), machine=PLENTY)
    hw, tgt = fitted.profile.hardware, fitted.profile.target
    assert hw.device_memory_gb == 8.0 and hw.host_ram_gb == 0 and hw.disk_budget_gb == target.stat().st_size / 1e9
    assert tgt.tier == "disk" and tgt.context_tokens == 2048  # what the tiny model was trained for
    plan = fitted.plan()
    assert set(plan.layer_tiers) == {"device"} and plan.machine is PLENTY
    tight = MachineMemory(int(plan.bytes_by_tier["device"] - 3 * plan.layer_bytes[0]), "cgroup limit 1 GB, 1 GB "
                          "of it free", 500_000_000)
    plan = load_fitted("cpu-demo", target=str(target), machine=tight).plan()
    assert "disk" in plan.layer_tiers and "device" in plan.layer_tiers
    assert plan.bytes_by_tier["device"] <= tight.usable
    assert "memory: " in plan.format() and "(cgroup limit 1 GB, 1 GB of it free, less 0.5 GB" in plan.format()


def test_a_small_gguf_on_the_targets_vocabulary_beside_it_is_the_minion(models):
    fitted = load_fitted("cpu-demo", target=str(models["target"]), machine=PLENTY)
    kinds = [(m.kind, m.name) for m in fitted.profile.minions]
    # the tiny target is under 1 GB: the profile's substitute stays
    assert kinds == [("gguf", "small.Q8_0"), ("substitute", "q3_k_m"), ("ngram", "ngram")]
    notes = "\n".join(fitted.notes)
    assert "minion small.Q8_0: " in notes and "next to the target, on the target's vocabulary" in notes
    assert "other.Q8_0.gguf (another vocabulary: " in notes
    assert "twin.gguf (" in notes and "more than a tenth of the target" in notes
    report = plan_report("cpu-demo", target=str(models["target"]))
    on_llama = gguf_on_llama_cpp("auto", "cpu")
    assert "minion small.Q8_0: gguf" in report and "passed over:" in report
    assert ("computed as they are by llama.cpp" in report) == on_llama != ("dequantized into" in report)


def test_a_folder_is_found_when_no_gguf_is_and_a_large_target_has_no_substitute(models, monkeypatch):
    monkeypatch.setattr(fitting, "SUBSTITUTE_BELOW", 1000)
    fitted = load_fitted("cpu-demo", target=str(models["alone"]), machine=PLENTY)
    assert [(m.kind, m.name) for m in fitted.profile.minions] == [("hf", "hf"), ("ngram", "ngram")]
    assert any(n.startswith("no 'q3_k_m' substitute: the target re-quantized would be nearly as large")
               for n in fitted.notes)


def test_with_nothing_beside_it_only_ngram_and_how_to_name_one(models, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(fitting, "SUBSTITUTE_BELOW", 1000)
    lone = shutil.copy(models["target"], tmp_path / "lone.gguf")
    fitted = load_fitted("cpu-demo", target=str(lone), machine=PLENTY)
    assert [m.kind for m in fitted.profile.minions] == ["ngram"]
    assert any("only n-gram drafts; name one with --minion PATH" in n for n in fitted.notes)


def test_named_minions_are_kept_and_one_off_the_vocabulary_is_refused_before_loading(models):
    fitted = load_fitted("cpu-demo", target=str(models["target"]), minions=[str(models["small"]), "ngram"],
                         machine=PLENTY)
    assert [m.name for m in fitted.profile.minions] == ["small.Q8_0", "ngram"]
    with pytest.raises(VocabularyMismatchError, match=r"The minion .*other.Q8_0.gguf does not share the target's "
                                                      r"vocabulary: target .*target.Q4_K.gguf has 96 tokens"):
        plan_report("cpu-demo", target=str(models["target"]), minions=[str(models["other"])])


def test_a_short_memory_shortens_the_context_then_says_what_to_do(models):
    fitted = load_fitted("cpu-demo", target=str(models["target"]), machine=PLENTY)
    plan = fitted.plan()
    kv = next(p.bytes for p in plan.placements if p.what == "KV cache target")
    floor = plan.bytes_by_tier["device"] - sum(plan.layer_bytes)
    room = MachineMemory(int(floor - kv * 0.6 + plan.layer_bytes[0]), "MemAvailable 0.1 GB", 0)
    short = load_fitted("cpu-demo", target=str(models["target"]), machine=room)
    assert short.profile.target.context_tokens < 2048
    assert any(n.startswith(f"context: {short.profile.target.context_tokens} tokens, not 4096") for n in short.notes)
    with pytest.raises(MemoryPlanError) as err:
        load_fitted("cpu-demo", target=str(models["target"]), machine=MachineMemory(1000, "MemAvailable 0.5 GB",
                                                                                     500_000_000))
    text = str(err.value)
    assert str(models["target"]) in text and "with a context of 512 tokens" in text
    assert "this machine has 0.0 GB usable (MemAvailable 0.5 GB, less 0.5 GB for this process)" in text
    assert "Free memory" in text and "Q4_K" not in text.split("fewer bits")[-1]


def test_the_plan_suggests_fewer_bits_than_the_files_own():
    from minions_local.profile.gguf_sizes import fewer_bits

    assert fewer_bits(4.8)[0] == "Q3_K_M"  # a Q4_K_M file: never Q4_K_M again
    assert fewer_bits(4.5)[0] == "Q3_K_M" and fewer_bits(3.9)[0] == "Q2_K" and fewer_bits(8.5)[0] == "Q6_K"
    assert fewer_bits(1.8) is None


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "no-shape"])
def test_a_bad_file_is_named_with_what_to_do(models, tmp_path, damage):
    path = tmp_path / "bad.gguf"
    if damage == "truncated":
        data = models["target"].read_bytes()
        path.write_bytes(data[: len(data) // 2])
        want = r"bad.gguf is not a readable GGUF file: tensor .* lies past the end of the file .*Re-download"
    elif damage == "garbage":
        path.write_bytes(b"<html>not found</html>" * 100)
        want = r"bad.gguf is not a readable GGUF file: it does not start with the GGUF magic bytes"
    elif damage == "missing":
        want = r"The GGUF file .*bad.gguf does not exist. Check the path"
    else:
        import gguf

        writer = gguf.GGUFWriter(str(path), "llama")  # a header with no shape keys at all
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        want = r"bad.gguf lacks llama.attention.head_count in its metadata, so its shape is unknown"
    with pytest.raises(MinionsError, match=want):
        plan_report("cpu-demo", target=str(path))


def test_a_named_tier_on_a_cpu(models):
    """'ram' is the same memory as the device on a CPU: what it does not hold comes from the
    file; 'device' that does not fit says so in this machine's terms."""
    plan = load_fitted("cpu-demo", target=str(models["target"]), machine=PLENTY).plan()
    tight = MachineMemory(int(plan.bytes_by_tier["device"] - 3 * plan.layer_bytes[0]), "MemAvailable 1 GB", 0)
    assert load_fitted("cpu-demo", target=str(models["target"]), tier="ram", machine=tight).profile.target.tier == "disk"
    no_kv = sum(p.bytes for p in plan.placements if not p.what.startswith("KV cache"))  # room for no cache at all
    short = MachineMemory(no_kv, "MemAvailable 1 GB", 0)
    with pytest.raises(MemoryPlanError, match=r"target.Q4_K.gguf needs .* to keep all 8 of its layers resident "
                                              r"\(tier 'device'\), but this machine has .* Leave the tier out"):
        load_fitted("cpu-demo", target=str(models["target"]), tier="device", machine=short)


def test_a_split_target_is_named_by_its_first_shard(models, tmp_path):
    """Any part names the model; llama.cpp, and a substitute made from it, need the first."""
    from tests.helpers.tiny_gguf import write_gguf

    first = write_gguf(models["target"].parent.parent / "src-big", tmp_path / "big.gguf", "Q4_K",
                       embedding_type="F16", shard_tensors=40)
    second = first.with_name(first.name.replace("00001-of", "00002-of"))
    fitted = load_fitted("cpu-demo", target=str(second), machine=PLENTY)
    assert fitted.profile.target.path == str(first)
    assert [m.path for m in fitted.profile.minions if m.kind == "substitute"] == [str(first)]
    assert fitted.profile.hardware.disk_budget_gb * 1e9 == pytest.approx(first.stat().st_size + second.stat().st_size)
