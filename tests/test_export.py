"""experiments/export.py: a trained run of each arm, exported as a user runs it, loaded by transformers
with no custom code, gives our model's logits and greedy continuations, and our tokenizer's ids."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import HERE, SCRIPT_ENV, assert_one_error_line, train_cli, write_choice_task
from experiments import evaluate, export
from leviathan import EMBEDDINGS, generate_text
from prepare_data import read_shard, shard_paths
from sample import load_model

transformers = pytest.importorskip("transformers", reason=f"needs transformers: {export.INSTALL}")

# seq_len 128: a 16-token prompt and 64 new tokens fit in one window (ours slides past seq_len, theirs
# extrapolates the rotary positions); 20 steps, so that greedy decoding follows the corpus's grammar.
RUN = ["--seq_len=128", "--batch_tokens=1024", "--total_tokens=30720", "--eval_tokens=1024", "--lr=1e-2"]
TEXTS = ["The cat sat on the mat. Alice liked the river.",
         "def main(argv=None):\n    return run_main(export, argv)  # 3.14159 and 1,000,000\n",
         "  Ünïcödé: 東京, Москва, ∑ x² ≥ 0 🙂\r\n\ttabs\t\tand   runs   of spaces   ",
         "it's, they'll, WE'VE, I'd <|endoftext|> <|fim_prefix|>"]


def run_export(run, hf_dir, *args):
    return subprocess.run([sys.executable, "-m", "experiments.export", f"--out_dir={run}", f"--hf_dir={hf_dir}",
                           *args], cwd=HERE, env=SCRIPT_ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", params=EMBEDDINGS)
def exported(request, train_data, tmp_path_factory):
    """(run folder, export folder, export's stdout) of a 20-step run of the arm."""
    tmp = tmp_path_factory.mktemp(f"export-{request.param}")
    train_cli(train_data, tmp / "run", f"--embedding={request.param}", *RUN)
    r = run_export(tmp / "run", tmp / "hf")
    assert r.returncode == 0, r.stderr
    return tmp / "run", tmp / "hf", r.stdout


def val_windows(train_data, n, length):
    tokens = read_shard(shard_paths(train_data, "val")[0])[:].astype(np.int64)
    starts = np.linspace(0, len(tokens) - length, n).astype(int)
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]))


def test_export_gives_the_models_logits_and_greedy_text(exported, train_data):
    run, hf_dir, stdout = exported
    model, tok, step = load_model(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert os.path.isfile(hf_dir / "model.safetensors") and "with tokenizer" in stdout, stdout
    config = json.loads((hf_dir / "config.json").read_text())
    record = config["leviathan"]
    assert (record["embedding"], record["step"]) == (model.cfg.embedding, step)
    assert record["model_config"]["lev_sigmoid_scale"] == model.cfg.lev_sigmoid_scale
    assert config["tie_word_embeddings"] == (model.cfg.embedding == "tied")
    if model.cfg.embedding == "tied":
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    idx = val_windows(train_data, 4, model.cfg.seq_len)
    with torch.no_grad():
        expected, got = model(idx), hf(idx).logits
    difference = (got - expected).abs().max().item()
    print(f"{model.cfg.embedding}: max |logits difference| {difference:.2e}")  # -s shows it
    assert difference <= 1e-4, difference

    # greedy: 64 new tokens (fewer if both stop at end-of-text, which theirs includes and ours does not)
    prompt = idx[1, :16].tolist()
    ours = list(generate_text(model, prompt, 64, temperature=0, stop_id=tok.eot_token, n_valid=tok.n_vocab))
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    assert out[:len(ours) + 1] == ours + [tok.eot_token] * (len(ours) < 64) and len(ours) >= 32, (ours, out)
    assert max(ours) < tok.n_vocab
    print(f"{model.cfg.embedding}: greedy {len(ours)} tokens, {len(set(ours))} distinct: {tok.decode(ours)[:60]!r}")


def test_exported_tokenizer_encodes_as_ours(exported, train_data):
    run, hf_dir, _ = exported
    _, tok, _ = load_model(run)
    fast = transformers.AutoTokenizer.from_pretrained(hf_dir)
    real = tok.decode(val_windows(train_data, 1, 100)[0].tolist())
    for text in TEXTS + [real]:
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode_ordinary(text), text
        assert fast.decode(ids) == text
    assert fast.eos_token_id == tok.eot_token
    # add_bos_token=True (lm-eval's hf model's argument): end-of-text first, as every document in training
    with_eot = transformers.AutoTokenizer.from_pretrained(hf_dir, add_bos_token=True)
    assert with_eot(TEXTS[0])["input_ids"] == [tok.eot_token] + tok.encode_ordinary(TEXTS[0])


def test_wrong_folder_and_missing_transformers_are_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert export.main([f"--out_dir={tmp_path}", f"--hf_dir={tmp_path / 'other'}"]) == 1
    assert_one_error_line(1, capsys.readouterr().err, "not an export of this tool")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    assert export.main([f"--out_dir={tmp_path}", f"--hf_dir={tmp_path / 'hf'}"]) == 1
    assert_one_error_line(1, capsys.readouterr().err, export.INSTALL)


@pytest.mark.parametrize("exported", ["lev"], indirect=True)  # the same for every arm
def test_an_export_replaces_only_its_own_earlier_export_whole(exported, tmp_path, monkeypatch, capsys):
    """A re-export swaps a new folder in whole: no tokenizer left from the earlier one (--no-tokenizer); one
    that fails midway (a full disk) leaves the earlier export as it was, and the same command then completes;
    a folder holding a file the export did not write, or a changed one, is refused and left as it is; an
    empty --hf_dir is refused before any work."""
    run, first, _ = exported
    hf_dir = tmp_path / "hf"
    assert export.main([f"--out_dir={run}", f"--hf_dir={hf_dir}"]) == 0
    assert (hf_dir / "tokenizer.json").exists()
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    def full_disk(path, tensors):  # half the file written, then no space left
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device", path)
    with monkeypatch.context() as m:
        m.setattr(export, "write_safetensors", full_disk)
        assert export.main([f"--out_dir={run}", f"--hf_dir={hf_dir}", "--no-tokenizer"]) == 1
    assert_one_error_line(1, capsys.readouterr().err, "No space left on device")
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before  # the earlier export, whole
    assert export.main([f"--out_dir={run}", f"--hf_dir={hf_dir}", "--no-tokenizer"]) == 0
    assert not (hf_dir / "tokenizer.json").exists() and not (tmp_path / "hf.partial").exists()
    capsys.readouterr()
    for name, change in [("notes.txt", "mine"), ("model.safetensors", b"a model saved over it")]:
        (hf_dir / name).write_bytes(change.encode() if isinstance(change, str) else change)
        kept = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
        assert export.main([f"--out_dir={run}", f"--hf_dir={hf_dir}"]) == 1
        assert_one_error_line(1, capsys.readouterr().err, "holds files this tool did not write", name)
        assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == kept
        (hf_dir / "notes.txt").unlink(missing_ok=True)
    monkeypatch.setattr(export, "load_model", lambda *a: pytest.fail("loaded the model before refusing"))
    assert export.main([f"--out_dir={run}", "--hf_dir="]) == 1
    assert_one_error_line(1, capsys.readouterr().err, "--hf_dir is empty")


@pytest.mark.parametrize("exported", ["lev"], indirect=True)  # the same for every arm
def test_an_export_through_a_symlink_lands_where_it_points_and_a_mount_point_is_refused_first(
        exported, tmp_path, monkeypatch, capsys):
    """--hf_dir a symlink to a folder: the export is swapped in there, twice, the link kept. --hf_dir a mount
    point (which no rename can swap for the new folder, the export's last step): refused before any work."""
    run, _, _ = exported
    link, real = tmp_path / "link", tmp_path / "elsewhere" / "hf"
    real.mkdir(parents=True)
    link.symlink_to(real)
    for _ in range(2):
        assert export.main([f"--out_dir={run}", f"--hf_dir={link}"]) == 0
        assert link.is_symlink() and (real / "config.json").exists()
    assert sorted(os.listdir(tmp_path / "elsewhere")) == ["hf"]
    capsys.readouterr()
    monkeypatch.setattr(export.os.path, "ismount", lambda path: path == str(real))
    monkeypatch.setattr(export, "load_model", lambda *a: pytest.fail("loaded the model before refusing"))
    assert export.main([f"--out_dir={run}", f"--hf_dir={link}"]) == 1
    assert_one_error_line(1, capsys.readouterr().err, f"--hf_dir={link} is a mount point", "a folder inside it")


@pytest.mark.parametrize("exported", ["lev"], indirect=True)  # the same for every arm
def test_lm_evals_own_hf_model_on_the_export_gives_each_choices_log_likelihood(exported, train_data, tmp_path,
                                                                              monkeypatch):
    """experiments.evaluate's scoring, lm-eval's `hf` model on the export with add_bos_token=True, conditions each
    context on end-of-text, as training does: on a local multiple-choice task of the corpus's own text, every
    choice's log-likelihood is the one transformers gives on the export, computed here by hand, to 1e-4."""
    lm_eval = pytest.importorskip("lm_eval", reason=f"needs lm-eval: {evaluate.INSTALL}")
    run, _, _ = exported
    _, tok, _ = load_model(run)
    words = tok.decode(val_windows(train_data, 1, 4000)[0].tolist()).split()
    assert len(words) > 30 * 20 + 21
    docs = [{"question": " ".join(words[i:i + 12]), "choices": [" ".join(words[i + 12 + 3 * k:i + 15 + 3 * k])
                                                               for k in range(3)], "label": 0}
            for i in range(0, 30 * 20, 20)]
    task = write_choice_task(tmp_path / "tasks", docs)
    for name, value in dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    outputs, real_evaluate = [], lm_eval.simple_evaluate  # what evaluate.py's call gets back from lm-eval
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: outputs.append(real_evaluate(**kw)) or outputs[0])
    assert evaluate.main([f"--out_dir={run}", "--tasks=local_choice", f"--include_path={task}", "--device=cpu"]) == 0
    samples = sorted(outputs[0]["samples"]["local_choice"], key=lambda s: s["doc_id"])
    theirs = [[resp[0][0] for resp in s["resps"]] for s in samples]
    hf = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()

    def by_hand(question, choice):  # end-of-text, the question, then " " + choice (lm-eval's target_delimiter)
        context, continuation = [tok.eot_token] + tok.encode_ordinary(question), tok.encode_ordinary(" " + choice)
        with torch.no_grad():
            logits = hf(torch.tensor([context + continuation])).logits[0, len(context) - 1:-1]
        return logits.log_softmax(-1).gather(1, torch.tensor(continuation)[:, None]).sum().item()
    ours = [[by_hand(doc["question"], choice) for choice in doc["choices"]] for doc in docs]
    assert np.allclose(theirs, ours, rtol=0, atol=1e-4), (theirs[:2], ours[:2])
