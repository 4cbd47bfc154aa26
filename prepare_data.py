"""Turn a text corpus into token shards for Leviathan training.

    python prepare_data.py                      # uncopyrighted Pile, Hugging Face Hub -> data/pile/
    python prepare_data.py --dataset=demo       # offline: Python's stdlib + pydoc topics -> data/demo/
    python prepare_data.py --dataset=c.jsonl.zst    # local .jsonl[.zst]/.parquet/.txt, glob, folder
    python prepare_data.py --max_tokens=1_000_000_000 --shard_tokens=100_000_000

The shards, meta.json and counts.npy it writes are described in data.py (the shard format).
Interrupted? Run the same command again: it resumes after the last complete shard.
"""
import functools, glob, json, os, platform, shlex, socket, sys, time, urllib.parse
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cli import ArgumentParser, UserError, print_error
from data import (HEADER_INTS, VERSION, ShardWriter, atomic_write, demo_documents, get_tokenizer, read_shard, shard_paths,
                  token_dtype, write_json)

SPLITS = ("val", "train")  # val first: it is small, so a broken setup shows up within seconds


# ---------------------------------------------------------------------------- documents

SUFFIXES = (".jsonl.zst", ".jsonl", ".parquet", ".txt")
HUB_REPO = "monology/pile-uncopyrighted"


def find_files(spec):
    """The files a PATH, glob or folder names, sorted so that document order is reproducible."""
    if os.path.isdir(spec):
        found = [os.path.join(root, f) for root, _, files in os.walk(spec) for f in files]
    elif any(c in spec for c in "*?["):
        found = glob.glob(spec, recursive=True)
    elif os.path.isfile(spec):
        found = [spec]
        if not spec.endswith(SUFFIXES):
            raise UserError(f"{spec}: unsupported file type; use {', '.join(SUFFIXES)}")
    else:
        raise UserError(f"{spec}: no such file or directory (--dataset=demo needs no files)")
    files = sorted(f for f in found if f.endswith(SUFFIXES) and os.path.isfile(f))
    if not files:
        raise UserError(f"{spec}: no {', '.join(SUFFIXES)} files found")
    return files


def _zstd_chunks(path):
    # Hand-rolled instead of zstandard's stream_reader, which ends silently on a truncated file.
    import zstandard
    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        frame, in_frame = dctx.decompressobj(), False
        while data := f.read(1 << 20):
            offset = f.tell() - len(data)
            while data:  # a .zst file may hold several frames back to back
                try:
                    yield frame.decompress(data)
                except zstandard.ZstdError as e:
                    raise UserError(f"{path}: not valid zstd data near byte {offset} ({e})") from None
                in_frame = not frame.eof
                data = frame.unused_data if frame.eof else b""
                frame = dctx.decompressobj() if frame.eof else frame
        if in_frame:
            raise UserError(f"{path}: zstd data ends mid-frame at byte {f.tell()} (truncated file?)")


def _split_lines(chunks):
    pieces = []  # the unfinished line, kept as pieces so huge lines do not cost quadratic copying
    for chunk in chunks:
        *lines, tail = chunk.split(b"\n")
        if lines:
            lines[0] = b"".join(pieces + [lines[0]])
            pieces = []
            yield from lines
        pieces.append(tail)
    if b"".join(pieces):
        yield b"".join(pieces)


def _jsonl_texts(path, lines):
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # JSONDecodeError or invalid UTF-8
            raise UserError(f"{path}:{lineno}: not a valid JSON line ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise UserError(f"{path}:{lineno}: record has no string 'text' field "
                            '(expected {"text": ..., "meta": ...})')
        yield record["text"]


def _parquet_texts(path):
    import pyarrow.parquet as pq
    try:
        table = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a valid Parquet file ({e})") from None
    if "text" not in table.schema_arrow.names:
        raise UserError(f"{path}: no 'text' column (columns: {', '.join(table.schema_arrow.names)})")
    row = 0
    for batch in table.iter_batches(columns=["text"], batch_size=1024):  # bounded memory
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise UserError(f"{path}: row {row}: 'text' is {text!r}, not a string")
            row += 1
            yield text


def file_documents(files):
    for path in files:
        if path.endswith(".txt"):  # one document per file
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
        elif path.endswith(".parquet"):
            yield from _parquet_texts(path)
        elif path.endswith(".zst"):
            yield from _jsonl_texts(path, _split_lines(_zstd_chunks(path)))
        else:
            with open(path, "rb") as f:
                yield from _jsonl_texts(path, f)


def _hub_documents(split):
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    hint = "without network, use --dataset=PATH (.jsonl/.jsonl.zst/.parquet/.txt) or --dataset=demo"
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    if not any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        # One clear line at once: the Hub client would retry for tens of seconds, logging each retry.
        try:
            socket.create_connection((url.hostname, port), timeout=10).close()
        except OSError as e:
            raise UserError(f"cannot reach the Hugging Face Hub at {url.hostname} ({e}); {hint}") from None
    try:
        import datasets
        datasets.logging.set_verbosity_error()
        stream = datasets.load_dataset(HUB_REPO, split=split, streaming=True, data_files={
            "train": "train/*.jsonl.zst", "val": "val.jsonl.zst"})  # val is only found if named
        for record in stream:
            yield record["text"]
    except OSError as e:  # includes ConnectionError and requests' errors
        raise UserError(f"could not stream {HUB_REPO} from the Hub ({e}); {hint}") from None


# ---------------------------------------------------------------------------- pipeline

def _chunks(docs, max_chars=1 << 20, max_docs=512):
    chunk, chars = [], 0
    for item in docs:
        chunk.append(item)
        chars += len(item[1])
        if chars >= max_chars or len(chunk) >= max_docs:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode_chunk(tok, chunk):
    out = []
    for index, text in chunk:
        ids = tok.enc.encode_ordinary(text)
        ids.append(tok.eot)  # the document separator
        out.append((index, np.array(ids, dtype=token_dtype(tok.n_vocab))))
    return out


def _tokenized(tok, docs, workers):
    """(index, tokens + [eot]) for each document, in input order. tiktoken releases the GIL while
    encoding, so threads use every core; at most 2 chunks per thread are in flight (bounded memory)."""
    pool, pending = ThreadPoolExecutor(workers), deque()
    try:
        for chunk in _chunks(docs):
            pending.append(pool.submit(_encode_chunk, tok, chunk))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)


class _SplitWriter:
    """Cuts one split's token stream into fixed-size shards. After each complete shard it records in
    progress.json where the next shard starts (document index, tokens of it already written), so a
    rerun resumes there and writes the same bytes as an uninterrupted run."""

    def __init__(self, out_dir, split, vocab_size, shard_tokens, budget, state, save):
        self.out_dir, self.split, self.vocab_size = out_dir, split, vocab_size
        self.shard_tokens, self.budget, self.state, self.save = shard_tokens, budget, state, save
        self.resume_at = (state["next_doc"], state["skip"])
        self.tokens, self.documents, self.shard = state["tokens"], state["documents"], None

    def add(self, index, tokens):
        """Write one document's tokens; False once the token budget is spent."""
        pos = self.resume_at[1] if index == self.resume_at[0] else 0
        self.documents += pos == 0  # a resumed document was counted when it began
        while pos < len(tokens) and self.tokens < self.budget:
            if self.shard is None:
                name = f"{self.split}_{self.state['shards']:06d}.bin"
                self.shard = ShardWriter(os.path.join(self.out_dir, name), self.vocab_size)
            take = min(len(tokens) - pos, self.shard_tokens - self.shard.n, self.budget - self.tokens)
            self.shard.append(tokens[pos:pos + take])
            pos, self.tokens = pos + take, self.tokens + take
            if self.shard.n == self.shard_tokens:
                self._finish_shard(*((index, pos) if pos < len(tokens) else (index + 1, 0)))
        return self.tokens < self.budget

    def close(self):
        if self.shard is not None and self.shard.n:
            self._finish_shard(self.state["next_doc"], self.state["skip"])
        self.state["done"] = True
        self.save()

    def _finish_shard(self, next_doc, skip):
        self.shard.finish()
        self.shard = None
        self.state.update(shards=self.state["shards"] + 1, next_doc=next_doc, skip=skip,
                          tokens=self.tokens, documents=self.documents)
        self.save()


class ProgressMeter:
    """A progress line on stderr every 10 s: documents, tokens, tokens/s and, when the total is
    known (--max_tokens), the time left. Hours of Pile tokenization need it; the demo never shows it."""

    def __init__(self, split, tokens, total):
        self.split, self.start_tokens, self.total = split, tokens, total
        self.start = self.last_line = time.time()

    def line(self, documents, tokens, final=False):
        rate = (tokens - self.start_tokens) / max(time.time() - self.start, 1e-9)
        left = f", {(self.total - tokens) / rate:,.0f} s left" if self.total and rate and not final else ""
        return f"{self.split}: {documents:,} documents, {tokens:,} tokens, {rate:,.0f} tokens/s{left}"

    def update(self, documents, tokens):
        if time.time() - self.last_line >= 10:
            self.last_line = time.time()
            print(self.line(documents, tokens), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- driver

def _parse_args(argv):
    parser = ArgumentParser("prepare_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="pile", help="pile (Hugging Face Hub), demo, or a PATH/glob/folder")
    parser.add_argument("--val", help="PATH of validation documents (default: every Nth document of --dataset)")
    parser.add_argument("--val_fraction", type=float,
                        help="val = every round(1/f)-th document (default 0.01; demo 0.05)")
    parser.add_argument("--val_tokens", type=int, default=10_000_000, help="stop the val split at this many tokens")
    parser.add_argument("--max_tokens", type=int, help="stop the train split after this many tokens")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000,
                        help="tokens per shard (the last of a split: the rest)")
    parser.add_argument("--tokenizer", default="o200k_base", help="tiktoken encoding name")
    parser.add_argument("--vocab_size", type=int, help="first N-1 merges + end-of-text (demo: 8192; 0 = all)")
    parser.add_argument("--name", help="output folder name under data/ (default: from --dataset)")
    parser.add_argument("--out_dir", help="output folder (default: data/NAME)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer threads")
    args = parser.parse_args(argv)
    if args.val_fraction is None:  # the demo corpus has only ~700 documents: 8 would be a noisy val set
        args.val_fraction = 0.05 if args.dataset == "demo" else 0.01
    if not 0 < args.val_fraction <= 0.5 and not args.val:
        raise UserError("--val_fraction must be in (0, 0.5]")
    for name, bad, allowed in [("shard_tokens", not 0 < args.shard_tokens < 1 << 31, "in [1, 2**31) (the header's int32 count)"),
                               ("val_tokens", args.val_tokens < 1, ">= 1"),
                               ("max_tokens", args.max_tokens is not None and args.max_tokens < 1, ">= 1"),
                               ("workers", args.workers < 1, ">= 1 (tokenizer threads)")]:
        if bad:
            raise UserError(f"--{name}={getattr(args, name)}: must be {allowed}")
    if args.vocab_size is None and args.dataset == "demo":
        args.vocab_size = 8192  # a small model on a small corpus learns little about 200k rare ids
    return args


def _sources(args):
    """(name, description, {split: (documents function, keep(document index) predicate)})."""
    everything = lambda i: True
    if args.dataset == "pile":
        name, desc = "pile", f"hf://datasets/{HUB_REPO} (train/*.jsonl.zst, val.jsonl.zst)"
        splits = {split: (functools.partial(_hub_documents, split), everything) for split in SPLITS}
    else:
        if args.dataset == "demo":
            name, docs = "demo", demo_documents
            desc = f"Python {platform.python_version()} standard library + pydoc_data.topics"
        else:
            docs = functools.partial(file_documents, find_files(args.dataset))
            desc = os.path.abspath(args.dataset)
            name = os.path.basename(args.dataset.rstrip("/"))
            if any(c in name for c in "*?["):  # a glob: name it after its folder
                name = os.path.basename(os.path.dirname(args.dataset))
            for suffix in SUFFIXES:
                name = name.removesuffix(suffix)
        every = max(1, round(1 / args.val_fraction))  # by index: deterministic, and no hashing cost
        splits = {"val": (docs, lambda i: i % every == 0), "train": (docs, lambda i: i % every != 0)}
        desc += "" if args.val else f"; val: every {every}th document"
    if args.val:  # an explicit validation set: all of it; every document of --dataset trains
        desc += f"; val: {os.path.abspath(args.val)}"
        splits = {"val": (functools.partial(file_documents, find_files(args.val)), everything),
                  "train": (splits["train"][0], everything)}
    return name, desc, splits


def _load_progress(out_dir, config):
    path = os.path.join(out_dir, "progress.json")
    if os.path.exists(path):
        with open(path) as f:
            progress = json.load(f)
        if progress["config"] != config:
            changed = sorted(k for k in config if config[k] != progress["config"].get(k))
            raise UserError(f"{out_dir} holds data prepared with other settings "
                            f"({', '.join(changed)}); use another --out_dir or delete that folder")
        return progress
    if shard_paths(out_dir, "train") or shard_paths(out_dir, "val"):
        raise UserError(f"{out_dir} already holds shards not made by this command; "
                        "use another --out_dir or delete them")
    fresh = dict(shards=0, next_doc=0, skip=0, tokens=0, documents=0, done=False)
    return {"config": config, "splits": {split: dict(fresh) for split in SPLITS}}


def _run_split(split, docs, keep, tok, args, out_dir, progress):
    state = progress["splits"][split]
    budget = (args.max_tokens or float("inf")) if split == "train" else args.val_tokens
    save = functools.partial(write_json, os.path.join(out_dir, "progress.json"), progress)
    writer = _SplitWriter(out_dir, split, tok.n_vocab, args.shard_tokens, budget, state, save)
    meter = ProgressMeter(split, state["tokens"], args.max_tokens if split == "train" else None)
    start = state["next_doc"]  # documents before it are already in complete shards: not re-encoded
    if state["shards"]:
        print(f"{split}: resuming after {state['shards']} complete shards (document {start})")
    wanted = ((i, text) for i, text in enumerate(docs()) if i >= start and keep(i))
    tokens = _tokenized(tok, wanted, args.workers)
    try:
        for index, ids in tokens:
            more = writer.add(index, ids)
            meter.update(writer.documents, writer.tokens)
            if not more:
                break
    finally:
        tokens.close()  # stop the worker threads whatever happened
    if writer.tokens == 0:  # checked before close(): a split marked done must not be empty
        raise UserError(f"the {split} split is empty: no documents reached it (empty corpus? for a "
                        "tiny corpus raise --val_fraction or pass --val=PATH)")
    writer.close()
    return meter.line(writer.documents, writer.tokens, final=True)


def prepare(argv=None):
    """Run prepare_data in-process with command-line arguments; returns the meta dict.
    Example: prepare(["--dataset=demo", "--out_dir=/tmp/demo"])."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    name, source, splits = _sources(args)  # bad paths fail here, before the slower tokenizer load
    tok = get_tokenizer(args.tokenizer, args.vocab_size or None)
    out_dir = args.out_dir or os.path.join("data", args.name or name)
    # Everything that changes the bytes written; a rerun with other values must not resume.
    config = dict(source=source, tokenizer=args.tokenizer, vocab_size=args.vocab_size or None,
                  val_fraction=args.val_fraction, val_tokens=args.val_tokens, max_tokens=args.max_tokens,
                  shard_tokens=args.shard_tokens, format_version=VERSION)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder {out_dir} ({e.strerror}); pass another --out_dir") from None
    progress = _load_progress(out_dir, json.loads(json.dumps(config)))
    for split in SPLITS:
        if not progress["splits"][split]["done"]:
            print(_run_split(split, *splits[split], tok, args, out_dir, progress))
    counts = np.zeros(tok.n_vocab, dtype=np.int64)  # counted from the shards: exact after resuming too
    for path in shard_paths(out_dir, "train"):
        tokens = read_shard(path)
        for i in range(0, len(tokens), 1 << 24):
            counts += np.bincount(tokens[i:i + (1 << 24)], minlength=tok.n_vocab)
    atomic_write(os.path.join(out_dir, "counts.npy"), lambda f: np.save(f, counts))
    meta = dict(tokenizer=tok.name, tokenizer_vocab_size=tok.truncated_to, vocab_size=tok.n_vocab,
                eot_id=tok.eot, dtype=token_dtype(tok.n_vocab).name, format_version=VERSION,
                header_int32=HEADER_INTS, shard_tokens=args.shard_tokens, source=source,
                python_version=platform.python_version(),
                splits={s: {k: progress["splits"][s][k] for k in ("tokens", "documents", "shards")}
                        for s in SPLITS},
                command=shlex.join(["python", "prepare_data.py", *argv]))
    write_json(os.path.join(out_dir, "meta.json"), meta)  # last: its presence means "complete"
    return meta


def main(argv=None):
    try:
        meta = prepare(argv)
    except UserError as e:
        print_error(e)
        return 1
    except OSError as e:  # a full disk, a folder without write permission, ...
        where = f" ({e.filename})" if e.filename else ""
        print_error(f"{e.strerror or e}{where}; complete shards are kept: fix it and run the same command to resume")
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: complete shards are kept; run the same command to resume", file=sys.stderr)
        return 130
    train, val = (meta["splits"][s]["tokens"] for s in ("train", "val"))
    print(f"done: {train:,} train and {val:,} val tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
