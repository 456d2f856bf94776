"""A damaged or missing shipped demo file is named, with how to restore it."""

import hashlib
import json
import shutil

import pytest

from minions_local.models import demo
from minions_local.backends.hf import check_model_folder
from minions_local.core.errors import ModelLoadError


@pytest.fixture
def fake_demo(tmp_path, monkeypatch, families):
    root = tmp_path / "demo_models"
    shutil.copytree(families["llama"]["target"], root / "target")
    files = {p.relative_to(root).as_posix(): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                               "size": p.stat().st_size}
             for p in root.rglob("*") if p.is_file()}
    (root / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))
    monkeypatch.setattr(demo, "DEMO_DIR", root)
    demo._manifest.cache_clear()
    demo.verify_member.cache_clear()
    yield root
    demo._manifest.cache_clear()
    demo.verify_member.cache_clear()


def test_intact_member_passes(fake_demo):
    assert check_model_folder(fake_demo / "target", "target") == fake_demo / "target"


def test_damaged_file_is_named_with_remedy(fake_demo):
    weights = fake_demo / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # same size, different bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="damaged") as err:
        check_model_folder(fake_demo / "target", "target")
    assert "model.safetensors" in str(err.value) and "train_demo_family.py" in str(err.value)


def test_missing_file_and_manifest(fake_demo):
    (fake_demo / "target" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        check_model_folder(fake_demo / "target", "target")
    (fake_demo / "manifest.json").unlink()
    demo._manifest.cache_clear()
    demo.verify_member.cache_clear()
    with pytest.raises(ModelLoadError, match="demo model family is missing"):
        check_model_folder(fake_demo / "target", "target")


def test_checks_look_where_the_family_ships():
    from minions_local.profile.loader import demo_models_dir

    assert demo.DEMO_DIR == demo_models_dir().resolve()
    assert demo.is_demo_path(demo_models_dir() / "target")
