"""sample.py: loading a run's model from its checkpoint, decoding, the command line, its refusals."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import (EOT, HERE, META, N_VALID, SCRIPT_ENV, assert_one_error_line, damage, exit_status, random_model,
                      run_script)

from test_leviathan import generated_ids
import sample
from leviathan import EMBEDDINGS, generate_text
from prepare_data import UserError, tokenizer_from_meta
from sample import TextStream, load_model


def test_text_stream_prints_only_whole_characters():
    tok = tokenizer_from_meta(META)
    text = "naïve café: 3€, 😀 done — ok"
    ids = tok.encode_ordinary(text)
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens did end inside a character, and were held back
    # an incomplete character at the very end still comes out, as U+FFFD
    stream = TextStream(tok)
    held = [stream.push(i) for i in tok.encode_ordinary("a😀")[:-1]]
    assert "".join(held) == "a" and stream.flush() == "\ufffd"


# sample.py: the command line


def save_run(folder, model, state=None, config=None, **extra):
    """A run folder holding a checkpoint of model (step 42) as train.py writes it; extra: more keys."""
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict() if state is None else state,
                "model_config": dict(model.cfg.__dict__) if config is None else config,
                "data_meta": META, "step": 42, **extra},
               os.path.join(folder, "ckpt.pt"))
    return str(folder)


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_load_model_rebuilds_model_and_tokenizer(tmp_path, embedding):
    model = random_model(embedding)
    model_back, tok, step = load_model(save_run(tmp_path, model))
    assert (tok.n_vocab, tok.eot_token, step) == (N_VALID, EOT, 42)
    model_back.freeze_lev()
    assert (model_back.frozen_table is not None) == (embedding == "lev")
    assert generated_ids(model_back, 20, temperature=0) == generated_ids(model, 20, temperature=0)


def test_cli_streams_the_sample_that_generate_gives(tmp_path):
    model = random_model("lev")
    folder = save_run(tmp_path / "run", model)
    r = run_script("sample.py", f"--out_dir={folder}", "--prompt=Once upon", "--num_samples=2",
                   "--max_new_tokens=25", "--seed=5", "--temperature=1.0", "--top_k=0", "--no-stop_at_eot")
    assert r.returncode == 0, r.stderr
    model_back, tok, _ = load_model(folder)
    model_back.freeze_lev()
    gen = torch.Generator().manual_seed(5)
    expected = []
    for _ in range(2):  # one generator for all samples, as in the CLI
        ids = list(generate_text(model_back, tok.encode_ordinary("Once upon"), 25, 1.0, 0, 1.0, gen, n_valid=N_VALID))
        assert len(ids) == 25
        expected.append("Once upon" + tok.decode(ids) + "\n")
    assert r.stdout == "---------------\n".join(expected)
    assert "lev arm, step 42" in r.stderr


def test_cli_prompt_sources_and_stop_at_eot(tmp_path, monkeypatch, capsys):
    """What main() hands to generate_text(): end-of-text for an empty prompt (or prompt file), a prompt
    file's text without its final newline, the stop id unless --no-stop_at_eot, n_valid."""
    folder = save_run(tmp_path / "run", random_model("untied"))
    (tmp_path / "prompt.txt").write_text("Once upon\n")
    (tmp_path / "empty.txt").write_text("\n")
    calls, real = [], sample.generate_text

    def spy(model, prompt_ids, *args, **kw):
        calls.append((list(prompt_ids), kw["stop_id"], kw["n_valid"]))
        return real(model, prompt_ids, *args, **kw)
    monkeypatch.setattr(sample, "generate_text", spy)
    assert sample.main([f"--out_dir={folder}", "--max_new_tokens=3"]) == 0
    assert sample.main([f"--out_dir={folder}", f"--prompt_file={tmp_path / 'prompt.txt'}",
                        "--no-stop_at_eot", "--max_new_tokens=3"]) == 0
    assert sample.main([f"--out_dir={folder}", f"--prompt_file={tmp_path / 'empty.txt'}", "--max_new_tokens=3"]) == 0
    tok = tokenizer_from_meta(META)
    assert calls == [([EOT], EOT, N_VALID), (tok.encode_ordinary("Once upon"), None, N_VALID), ([EOT], EOT, N_VALID)]
    assert "\nOnce upon" in capsys.readouterr().out


# Refusals: only where sampling would go on and print something other than what was asked, with no sign.
# Each is one line before any text, and each of these tests fails when its check is taken out.


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders: a good one, one whose tokenizer fills the head (no padding rows), one whose
    weights hold nan."""
    root = tmp_path_factory.mktemp("runs")
    model = random_model("lev")
    state = model.state_dict()
    vocab = model.cfg.vocab_size  # 384: a multiple of 128, as a --vocab_size=384 run's would be
    unpadded = {**META, "tokenizer_vocab_size": vocab, "vocab_size": vocab, "eot_id": vocab - 1}
    diverged = {**state, "norm.weight": torch.full_like(state["norm.weight"], math.nan)}
    damaged = save_run(root / "damaged", model)
    damage(os.path.join(damaged, "ckpt.pt"))
    return {"good": save_run(root / "good", model),
            "unpadded": save_run(root / "unpadded", model, data_meta=unpadded),
            "nan": save_run(root / "nan", model, state=diverged), "damaged": damaged}


REFUSED = {  # name -> (run, options, what the error line says)
    # dividing the logits by it: the least likely ids become the likeliest (with padding rows in
    # the head, their -inf logits turn +inf and torch fails instead)
    "negative temperature": ("unpadded", ["--temperature=-0.5"], "--temperature=-0.5 is negative"),
    # would draw greedily (where top_k's 0 means off)
    "top_p zero": ("good", ["--top_p=0"], "--top_p=0.0 is not in (0, 1]"),
    # would not filter at all (a percentage: 95 for 0.95)
    "top_p above one": ("good", ["--top_p=95"], "--top_p=95.0 is not in (0, 1]"),
    # greedy decoding of nan logits: id 0, again and again, printed as text
    "nan weights": ("nan", ["--temperature=0"], "norm.weight hold nan or inf", "earlier checkpoint"),
    # torch.load checks no CRC-32: a flipped bit would sample from other weights
    "damaged checkpoint": ("damaged", [], "ckpt.pt is damaged", "fails its CRC-32", "restore it from a copy"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_value_is_one_error_line_before_any_text(runs, case, capsys):
    run, options, *phrases = REFUSED[case]
    code = exit_status(sample.main, [f"--out_dir={runs[run]}", "--max_new_tokens=5", *options])
    out, err = capsys.readouterr()
    assert_one_error_line(code, err, *phrases)
    assert out == ""


def test_load_model_refuses_the_checkpoints_that_would_sample_another_model(runs):
    """The export and experiments.evaluate read runs through load_model: they get the same refusals."""
    with pytest.raises(UserError, match=re.escape("hold nan or inf")):
        load_model(runs["nan"])
    with pytest.raises(UserError, match=re.escape("is damaged")):
        load_model(runs["damaged"])
    torch.load(os.path.join(runs["damaged"], "ckpt.pt"), weights_only=True)  # what it guards: this loads


# Every other mistake is named by argparse, leviathan's Config, Python or torch; main turns an
# OSError or a ValueError into one line.


def test_an_oserror_or_valueerror_is_one_error_line(runs, tmp_path, capsys):
    model = random_model("lev")
    save_run(tmp_path / "bad", model, config={**model.cfg.__dict__, "embedding": "big"})
    for options, phrase in [([f"--out_dir={tmp_path / 'missing'}"], "No such file or directory"),
                            ([f"--out_dir={runs['good']}", f"--prompt_file={tmp_path / 'absent.txt'}"], "absent.txt"),
                            ([f"--out_dir={tmp_path / 'bad'}"], "embedding must be one of")]:
        code = exit_status(sample.main, options)
        out, err = capsys.readouterr()
        assert_one_error_line(code, err, phrase)
        assert out == ""


def test_a_refusal_in_a_process_is_one_line_and_status_1(runs):
    r = run_script("sample.py", f"--out_dir={runs['nan']}")
    assert_one_error_line(r.returncode, r.stderr, "hold nan or inf")
    assert r.returncode == 1 and r.stdout == ""


def test_output_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`python sample.py ... | head`: once the reader has gone, the script ends with status 0 and
    no BrokenPipeError on stderr, as a Unix tool does."""
    folder = save_run(tmp_path / "run", random_model("lev"))
    command = [sys.executable, os.path.join(HERE, "sample.py"), f"--out_dir={folder}", "--num_samples=20",
               "--max_new_tokens=200", "--no-stop_at_eot"]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=SCRIPT_ENV, text=True)
    writer.stdout.read(10)
    writer.stdout.close()  # the reader stops, as head does after its lines
    assert writer.wait(timeout=300) == 0
    assert "Error" not in writer.stderr.read()
