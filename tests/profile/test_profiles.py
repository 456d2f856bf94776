"""Profiles: every shipped one loads; bad input gets a message a user can act on."""

from __future__ import annotations

from pathlib import Path

import pytest

from minions_local.core.errors import ProfileError
from minions_local.planning.report import plan_report
from minions_local.profile import available_profiles, load_profile

SHIPPED = ["cpu-demo", "cpu-demo-disk", "cpu-demo-gguf-disk", "rtx3090-70b", "rtx4070ti-32b", "rtx4090-70b", "rtx4090-70b-gguf",
           "stdlib-demo", "stdlib-demo-disk"]

MINIMAL = """
[hardware]
device = "cpu"
device_memory_gb = 4
device_memory_gbps = 10
host_ram_gb = 2
disk_read_gbps = 1
host_to_device_gbps = 5
compute_tflops = {{ bfloat16 = 1.0 }}

[target]
path = "{target}"

[target.dims]
layers = 2
hidden = 64
intermediate = 128
heads = 4
kv_heads = 2
vocab = 100
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_profiles_are_listed_and_load():
    names = available_profiles()
    assert set(SHIPPED) <= set(names)
    for name in SHIPPED:
        profile = load_profile(name)
        assert profile.name == name
        assert Path(profile.target.path).is_absolute()
        for m in profile.minions:
            assert (m.path is None) == (m.kind == "ngram")
            assert m.path is None or Path(m.path).is_absolute()


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ProfileError) as err:
        load_profile("rtx4090-7b")
    text = str(err.value)
    assert "unknown profile 'rtx4090-7b'" in text
    assert "did you mean 'rtx4090-70b'" in text.lower()
    for name in SHIPPED:
        assert name in text


def test_misspelt_field_names_the_file_the_field_and_the_closest_name(tmp_path):
    path = write(tmp_path, MINIMAL.format(target="t").replace("host_ram_gb", "host_ram_gbb"))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    text = str(err.value)
    assert str(path) in text
    assert "hardware.host_ram_gbb" in text and "did you mean 'host_ram_gb'" in text
    assert "line 6" in text
    assert "missing" not in text  # the misspelling is reported once, not also as missing


def test_misspelt_field_in_the_second_minion(tmp_path):
    text = MINIMAL.format(target="t") + '\n[[minions]]\npath = "a"\n\n[[minions]]\npath = "b"\nquantisation = "nf4"\n'
    line = text.splitlines().index('quantisation = "nf4"') + 1
    with pytest.raises(ProfileError, match=rf"line {line}: unknown field 'minions\[1\].quantisation' — did you mean 'quantization'"):
        load_profile(write(tmp_path, text))


def test_bad_value_says_what_was_given(tmp_path):
    path = write(tmp_path, MINIMAL.format(target="t").replace('device = "cpu"', 'device = "tpu"'))
    with pytest.raises(ProfileError, match="hardware.device.*'tpu'"):
        load_profile(path)


def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(write(tmp_path, "[hardware\n"))
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.toml")


def test_minion_rules(tmp_path):
    base = MINIMAL.format(target="t")
    with pytest.raises(ProfileError, match="'ngram' minion has no path"):
        load_profile(write(tmp_path, base + '\n[[minions]]\nkind = "ngram"\npath = "x"\n'))
    with pytest.raises(ProfileError, match="needs a path"):
        load_profile(write(tmp_path, base + '\n[[minions]]\nkind = "hf"\n'))
    with pytest.raises(ProfileError, match="two minions are named 'a'"):
        load_profile(write(tmp_path, base + '\n[[minions]]\npath = "x/a"\n\n[[minions]]\npath = "y/a"\n'))


def test_path_forms_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIONS_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    text = MINIMAL.format(target="models:Big") + (
        '\n[[minions]]\npath = "demo:target"\n\n[[minions]]\npath = "~/small.gguf"\nkind = "gguf"\n'
        '\n[[minions]]\npath = "rel/m"\n\n[[minions]]\nkind = "ngram"\n'
    )
    profile = load_profile(write(tmp_path, text))
    assert profile.target.path == str(tmp_path / "models" / "Big")
    paths = [m.path for m in profile.minions]
    assert paths[0].endswith("minions_local/demo_models/target")
    assert paths[1] == str(tmp_path / "home" / "small.gguf")
    assert paths[2] == str(tmp_path / "rel" / "m")  # relative to the profile file
    assert paths[3] is None
    assert [m.backend for m in profile.minions] == ["transformers", "llama_cpp", "transformers", "ngram"]
    assert profile.source == str(tmp_path / "p.toml")


def test_overrides_replace_target_minions_and_tier(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profile = load_profile("rtx4090-70b", target="my70b", minions=["small", "x.gguf", "ngram"], tier="disk")
    assert profile.target.path == str(tmp_path / "my70b")
    assert profile.target.dims is None  # the shipped dims described another model
    assert profile.target.tier == "disk"
    kinds = [(m.kind, m.quantization, m.path) for m in profile.minions]
    assert kinds == [("hf", "nf4", str(tmp_path / "small")), ("gguf", "none", str(tmp_path / "x.gguf")),
                     ("ngram", "none", None)]


def test_plan_report_for_the_70b_profile_needs_no_weights():
    text = plan_report("rtx4090-70b")
    assert "Memory plan" in text and "streamed per pass" in text
    assert "tok/s" in text and "UMbreLLa" in text and "SpecExec" in text and "Sequoia" in text
    for a in ("0.50", "0.70", "0.90"):
        assert a in text


def test_plan_report_without_dims_explains(tmp_path):
    with pytest.raises(ProfileError, match="dimensions are unknown"):
        plan_report("rtx4090-70b", target=str(tmp_path))  # a folder without a config.json
    with pytest.raises(ProfileError, match="the target .*missing does not exist. Check the path"):
        plan_report("rtx4090-70b", target=str(tmp_path / "missing"))


def test_cli_exit_status_and_no_traceback(capsys):
    from minions_local.planning.cli import main

    assert main(["--plan", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile" in err and "Traceback" not in err
    assert main(["--plan", "rtx4090-70b"]) == 0
    assert main(["--schema"]) == 0
    assert "device_memory_gb" in capsys.readouterr().out


def test_engine_kwargs_from_profile_follow_the_plan():
    from minions_local.engine.from_profile import engine_kwargs_from_profile
    from minions_local.speculation.cost_policy import CostModelBudget

    kw = engine_kwargs_from_profile("rtx4090-70b")
    assert kw["device"] == "cuda" and kw["target_tier"] == "ram" and kw["dtype"] == "float16"
    assert kw["minions"][-1] == "ngram" and kw["target"].endswith("Llama-3.1-70B-Instruct")
    opts = kw["stream_options"]
    assert opts["quant"] == "int4" and opts["buffers"] == 2 and len(opts["layer_tiers"]) == 80
    assert isinstance(kw["budget"], CostModelBudget) and kw["memory_plan"].layer_tiers == opts["layer_tiers"]

    disk = engine_kwargs_from_profile("cpu-demo-disk", budget=16)
    assert disk["target_tier"] == "disk" and disk["budget"] == 16
    assert set(disk["stream_options"]["layer_tiers"]) == {"disk"}
    resident = engine_kwargs_from_profile("cpu-demo")
    assert resident["target_tier"] == "device" and resident["stream_options"] == {}


def test_readme_documents_every_field():
    from minions_local.profile import schema

    readme = (Path(__file__).resolve().parents[2] / "profiles" / "README.md").read_text()
    for model in (schema.Hardware, schema.TargetSection, schema.KnownDims, schema.MinionSection, schema.Speculation):
        for name in model.model_fields:
            assert f"`{name}`" in readme, f"profiles/README.md lacks {model.__name__}.{name}: regenerate with --schema"


def test_command_line_paths_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    folder = tmp_path / "profiles"
    folder.mkdir()
    text = MINIMAL.format(target="t") + '\n[[minions]]\npath = "beside"\n'
    path = write(folder, text)
    monkeypatch.chdir(tmp_path)
    profile = load_profile(path, target="mine")
    assert profile.target.path == str(tmp_path / "mine")
    assert profile.minions[0].path == str(folder / "beside")  # still relative to the profile file
    assert load_profile(path, minions=["demo:target"]).minions[0].path.endswith("demo_models/target")


def test_demo_profiles_point_at_the_shipped_family():
    from minions_local.profile.dims import dims_for
    from minions_local.profile.loader import demo_models_dir

    folder = demo_models_dir()
    if not folder.is_dir() or not any(folder.glob("*/config.json")):
        pytest.skip("the demo family is not built yet (scripts/demo_training.py)")
    for name in ("stdlib-demo", "stdlib-demo-disk"):
        profile = load_profile(name)
        for section in [profile.target] + [m for m in profile.minions if m.path]:
            assert (Path(section.path) / "config.json").is_file(), section.path
            real = dims_for(section.path, None, "model")
            listed = dims_for(None, section.dims, "model")
            assert (real.layers, real.hidden, real.intermediate, real.heads, real.kv_heads, real.vocab) == (
                listed.layers, listed.hidden, listed.intermediate, listed.heads, listed.kv_heads, listed.vocab
            ), f"{name}: the dims listed for {section.path} are stale"


def test_shipped_profiles_found_from_an_uninstalled_checkout(monkeypatch):
    """The GPU check runs the source tree on PYTHONPATH, where the package
    `minions_local.profiles_data` (pyproject's mapping of profiles/) does not exist:
    the checkout's profiles/ must still be found (its first run failed on exactly this)."""
    from minions_local.profile import loader

    def not_installed(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(loader, "files", not_installed)
    assert (loader.shipped_dir() / "rtx4090-70b.toml").is_file()
    assert loader.load_profile("rtx4090-70b").target is not None
