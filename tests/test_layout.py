"""The repository's promises about itself: what imports what, that leviathan.py stands alone, and
that the README's test command is what CI runs."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import HERE, SCRIPT_ENV

SCRIPTS = ("leviathan.py", "prepare_data.py", "train.py", "sample.py")


def local_imports(path):
    """The repository's own modules that a file imports (top-level names that exist here)."""
    tree = ast.parse(Path(HERE, path).read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return {name for name in names if Path(HERE, f"{name}.py").exists() or Path(HERE, name).is_dir()}


def test_the_top_level_is_the_four_scripts_and_their_tests():
    modules = sorted(p.name for p in Path(HERE).glob("*.py"))
    assert modules == sorted([*SCRIPTS, "test_leviathan.py"])


def test_import_rules():
    """leviathan.py imports nothing local; prepare_data.py imports no other script; training reads three
    files (train.py, leviathan.py, prepare_data.py), never sample.py; the scripts never import the research
    folder (it may import them)."""
    assert local_imports("leviathan.py") == set()
    assert local_imports("prepare_data.py") == set()
    assert local_imports("train.py") == {"leviathan", "prepare_data"}
    for script in SCRIPTS:
        assert "experiments" not in local_imports(script), script
    assert "experiments.acceptance" in research_imports("experiments/bench.py")  # `bench gpu`, an alias
    assert "experiments.bench" not in research_imports("experiments/acceptance.py")  # not the other way round


def research_imports(path):
    """The modules of experiments/ that a file imports, as experiments.NAME."""
    tree = ast.parse(Path(HERE, path).read_text())
    names = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    names |= {f"experiments.{alias.name}" for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module == "experiments" for alias in node.names}
    return {name for name in names if name.startswith("experiments.")}


def test_prepare_data_never_imports_torch():
    code = "import sys, prepare_data; assert 'torch' not in sys.modules, 'prepare_data imported torch'"
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=SCRIPT_ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_leviathan_py_can_be_copied_alone(tmp_path):
    """In a folder of its own, leviathan.py builds each arm and back-propagates its loss."""
    shutil.copy(Path(HERE, "leviathan.py"), tmp_path)
    code = """if True:
        import torch, leviathan
        for arm in leviathan.EMBEDDINGS:
            cfg = leviathan.Config(vocab_size=256, d_model=32, n_layer=1, n_head=2, seq_len=16, embedding=arm,
                                   lev_seed_dim=8, lev_heads=2, lev_knots=4, lev_rank=4)
            model = leviathan.Model(cfg)
            ids = torch.randint(0, 256, (2, 17))
            loss = model(ids[:, :-1], ids[:, 1:])
            loss.backward()
            if arm != "tied":  # a zero head predicts uniformly: ln 256
                assert abs(loss.item() - 5.5452) < 1e-3, (arm, loss.item())
    """
    env = {k: v for k, v in SCRIPT_ENV.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_test_command_is_what_ci_runs():
    ci_command = Path(HERE, ".ci", "run").read_text().strip().splitlines()[-1]
    assert ci_command == "python -m pytest -q test_leviathan.py tests"
    first_block = Path(HERE, "README.md").read_text().split("```bash\n")[1].split("```")[0].splitlines()
    assert len(first_block) == 2 and first_block[1] == ci_command  # install and train, then test
