"""lab/stage_models.py: packages cut into loads of bounded size come back whole."""

import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
spec = importlib.util.spec_from_file_location("stage_models", os.path.join(ROOT, "stage_models.py"))
stage_models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage_models)


def test_split_and_join_round_trip(tmp_path, monkeypatch):
    site = tmp_path / "site"
    package = site / "fake_model_pkg"
    (package / "weights").mkdir(parents=True)
    (package / "__init__.py").write_text("VALUE = 1\n")
    big = os.urandom(2_500_000)
    (package / "weights" / "model.bin").write_bytes(big)
    (site / "fake_model_pkg-1.0.dist-info").mkdir()
    (site / "fake_model_pkg-1.0.dist-info" / "METADATA").write_text("Name: fake-model-pkg\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    staged = tmp_path / "staged"
    stage_models.split(staged, 1_000_000, ["fake_model_pkg"])
    loads = sorted(staged.glob("load-*"))
    assert len(loads) >= 3
    for load in loads:  # every load within the bound
        assert sum(f.stat().st_size for f in load.rglob("*") if f.is_file()) <= 1_000_000

    joined = tmp_path / "joined"
    stage_models.join(staged, joined)
    assert (joined / "fake_model_pkg" / "weights" / "model.bin").read_bytes() == big
    assert (joined / "fake_model_pkg" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (joined / "fake_model_pkg-1.0.dist-info" / "METADATA").exists()
    sys.modules.pop("fake_model_pkg", None)
