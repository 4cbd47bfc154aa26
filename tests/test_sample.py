"""sample.py: loading a run's model from its checkpoint, decoding, the command line, bad input."""
import os
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import (EOT, HERE, META, N_VALID, SCRIPT_ENV, assert_one_error_line, assert_usage_error, exit_status,
                      random_model, run_script)

from test_leviathan import generated_ids
import sample
from leviathan import EMBEDDINGS, generate_text
from prepare_data import tokenizer_from_meta
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


def save_run(folder, model, state=None, config=None, meta=None):
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict() if state is None else state,
                "model_config": dict(model.cfg.__dict__) if config is None else config,
                "data_meta": META if meta is None else meta, "step": 42},
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


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """name -> (command-line arguments, what the error line must say, ...)."""
    root = tmp_path_factory.mktemp("bad")
    model = random_model("lev")
    good = f"--out_dir={save_run(root / 'good', model)}"
    config, state = dict(model.cfg.__dict__), model.state_dict()
    (root / "empty").mkdir()
    (root / "corrupt").mkdir()
    (root / "corrupt" / "ckpt.pt").write_bytes(b"not a checkpoint")
    (root / "zero").mkdir()
    (root / "zero" / "ckpt.pt").write_bytes(b"")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    (root / "long.txt").write_text("word " * 100)

    def run_dir(name, **kw):
        return f"--out_dir={save_run(root / name, model, **kw)}"
    return {
        "no folder": ([f"--out_dir={root / 'missing'}"], "not found"),
        "no checkpoint": ([f"--out_dir={root / 'empty'}"], "no checkpoint"),
        "corrupt": ([f"--out_dir={root / 'corrupt'}"], "is not a readable train.py checkpoint"),
        "zero bytes": ([f"--out_dir={root / 'zero'}"], "is not a readable train.py checkpoint"),
        "unknown config key": ([run_dir("k", config={**config, "n_expert": 8})], "n_expert"),
        "bad config value": ([run_dir("v", config={**config, "embedding": "big"})], "embedding must be"),
        "wrong shape": ([run_dir("s", state={**state, "head.weight": torch.zeros(384, 32)})],
                        "weights do not fit", "head.weight", "[384, 32]"),
        "missing weight": ([run_dir("m", state={k: v for k, v in state.items() if k != "norm.weight"})],
                           "weights do not fit", "Missing", "norm.weight"),
        "nan weights": ([run_dir("n", state={**state, "norm.weight": torch.full_like(state["norm.weight"], math.nan)})],
                        "norm.weight hold nan or inf"),
        "bad tokenizer": ([run_dir("t", meta={**META, "tokenizer": "nope"})], "unknown tokenizer"),
        "prompt file not UTF-8": ([good, f"--prompt_file={root / 'latin1.txt'}"], "--prompt_file", "utf8_text"),
        "missing prompt file": ([good, f"--prompt_file={root / 'absent.txt'}"], "No such file", "absent.txt"),
        "two prompts": ([good, "--prompt=hi", f"--prompt_file={root / 'long.txt'}"], "not allowed with"),
        "prompt too long": ([good, f"--prompt_file={root / 'long.txt'}"], "shorten it"),
        "negative temperature": ([good, "--temperature=-1"], "temperature must be >= 0"),
        "infinite temperature": ([good, "--temperature=inf"], "temperature must be >= 0 and finite"),
        "seed too large": ([good, f"--seed={2**64}"], "--seed must be in [0, 2^63)"),
        "fractional count": ([good, "--max_new_tokens=2.5"], "invalid int value: '2.5'"),
        "top_p zero": ([good, "--top_p=0"], "top_p must be in (0, 1]"),
        "top_p above one": ([good, "--top_p=1.5"], "top_p must be in (0, 1]"),
        "negative top_k": ([good, "--top_k=-1"], "top_k must be >= 0"),
        "no samples": ([good, "--num_samples=0"], "--num_samples must be at least 1"),
        "no new tokens": ([good, "--max_new_tokens=0"], "--max_new_tokens must be at least 1"),
        "unknown option": ([good, "--temprature=1"], "unrecognized arguments"),
        "bad flag": ([good, "--stop_at_eot=maybe"], "ignored explicit argument 'maybe'"),
        "no out_dir": (["--prompt=hi"], "out_dir"),
        "unusable device": ([good, "--device=nodevice"], "device 'nodevice' is not usable"),
        "device not built": ([good, "--device=mps"], "device 'mps' is not usable here (this torch was not built"),
    }


BAD = ["no folder", "no checkpoint", "corrupt", "zero bytes", "unknown config key", "bad config value",
       "wrong shape", "missing weight", "nan weights", "bad tokenizer", "prompt file not UTF-8",
       "missing prompt file", "two prompts", "prompt too long", "negative temperature", "infinite temperature",
       "seed too large", "fractional count", "top_p zero", "top_p above one", "negative top_k", "no samples",
       "no new tokens", "unknown option", "bad flag", "no out_dir", "unusable device"]
BAD += [] if torch.backends.mps.is_available() else ["device not built"]


# argparse's own refusals: its usage line, then its error line, status 2
USAGE = {"prompt file not UTF-8", "two prompts", "fractional count", "unknown option", "bad flag", "no out_dir"}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gives_one_error_line(bad_inputs, case, capsys):
    # In-process through main(), the CLI's entry point: an exception escaping it fails here.
    args, *phrases = bad_inputs[case]
    code = exit_status(sample.main, args)
    out, err = capsys.readouterr()
    if case in USAGE:
        assert_usage_error(code, err, "sample.py", *phrases)
    else:
        assert_one_error_line(code, err, *phrases)
    assert out == ""


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


def test_bad_input_as_a_process(bad_inputs):
    """The same, as real processes, for one case from each stage (arguments, checkpoint,
    weights, prompt), run at once: each `python sample.py` pays for its imports."""
    cases = ["negative temperature", "no checkpoint", "wrong shape", "prompt too long"]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(lambda case: run_script("sample.py", *bad_inputs[case][0]), cases))
    for case, r in zip(cases, results):
        assert_one_error_line(r.returncode, r.stderr, *bad_inputs[case][1:])
        assert r.stdout == ""


