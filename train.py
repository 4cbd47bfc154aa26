"""Train a Leviathan model (or one of its two baselines) on token shards from prepare_data.py.

    python train.py --size=tiny --dataset=demo                 # CPU, a few minutes
    python train.py --size=200m --embedding=tied               # one GPU
    torchrun --nproc_per_node=8 train.py --size=1.2b           # DDP; add --nnodes/--rdzv_* for several nodes
    python train.py --size=200m --resume                       # continue out/200m-lev exactly
    python train.py --size=200m --eval_only                    # evaluate its checkpoint

Every field of TrainConfig below is an option: --key=value (a bare --flag means true).
Fields left at None take the value of the chosen --size (SIZE_DEFAULTS, and the model presets
in leviathan.SIZES). `python train.py --help` lists them all with their defaults.
"""
import dataclasses, datetime, inspect, json, math, os, signal, sys, time, types
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from leviathan import EMBEDDINGS, SIZES, Config, Model, padded_vocab
from prepare_data import (ShardError, load_meta, print_error, read_shard, shard_paths, tokenizer_from_meta,
                          write_json)


@dataclass
class TrainConfig:
    # what to train, on what
    size: str = "tiny"  # tiny | 200m | 400m | 1.2b (leviathan.SIZES)
    embedding: str = "lev"  # lev (Leviathan) | tied (the paper's baseline) | untied (ablation)
    dataset: str | None = None  # reads data/<dataset>/ (prepare_data.py); tiny: demo, others: pile
    data_dir: str = ""  # a data folder given directly (overrides --dataset)
    out_dir: str = ""  # default out/<size>-<embedding>
    # model shape: None keeps the size preset (vocab_size always comes from the data)
    d_model: int | None = None
    n_layer: int | None = None
    n_head: int | None = None
    seq_len: int | None = None
    rope_theta: float | None = None
    lev_digits: int | None = None
    lev_seed_dim: int | None = None
    lev_heads: int | None = None
    lev_knots: int | None = None
    lev_rank: int | None = None
    # budget, batch and optimiser: None takes SIZE_DEFAULTS[size]
    total_tokens: int | None = None  # training tokens; steps = total_tokens // batch_tokens
    batch_tokens: int | None = None  # tokens per optimizer step, over all GPUs (fixed whatever the world size)
    micro_batch: int | None = None  # sequences per GPU per forward pass; accumulation fills the rest
    lr: float | None = None  # peak learning rate of the backbone
    lr_input: float | None = None  # x lr for the input side (LEV, or the table); None: the arm's LR_SCALES
    lr_head: float | None = None  # x lr for the untied head (lev, untied); None: the arm's LR_SCALES
    warmup_steps: int | None = None
    min_lr_frac: float = 0.1  # cosine decay ends at min_lr_frac * lr
    weight_decay: float = 0.1  # backbone and head matrices only (see make_optimizer)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337  # model init and data order
    # evaluation, logging, checkpoints
    eval_interval: int | None = None  # steps between evaluations (and one at the end)
    eval_tokens: int | None = None  # validation tokens evaluated (the first ones of the val split)
    log_interval: int = 10
    ckpt_interval: int | None = None
    eval_only: bool = False  # evaluate out_dir/ckpt.pt and exit
    resume: bool = False  # continue from out_dir/ckpt.pt
    stop_step: int = 0  # save and exit after this step, schedule unchanged (0: run to the end)
    # hardware
    device: str = "auto"  # auto | cpu | cuda
    compile: bool | None = None  # torch.compile; None: on for CUDA, off for CPU
    bf16: bool | None = None  # bf16 autocast (LEV and the loss stay float32); None: on for CUDA, off for CPU
    bf16_allreduce: bool = False  # DDP: all-reduce gradients in bf16, half the traffic (for several nodes)
    deterministic: bool = False  # deterministic kernels: bit-identical reruns and resumes (CUDA: slower; README)
    wandb_project: str = ""  # log to Weights & Biases (needs `pip install wandb`)
    wandb_run_name: str = ""

    def __post_init__(self):
        """Refuse out-of-range values before any work starts; None means "from the size" and is
        checked once resolve() has filled it in. Model shapes are Config's to check."""
        for name, (allowed, bounds, why) in TRAIN_RULES.items():
            value = getattr(self, name)
            if value is not None and not allowed(value):
                raise TrainError(f"--{name}={value}: must be {bounds} ({why})")
        if self.wandb_run_name and not self.wandb_project:
            raise TrainError("--wandb_run_name needs --wandb_project")


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


# What each option may be: (test, the allowed range as the error states it, why).
TRAIN_RULES = {
    "size": (lambda v: v in SIZES, f"one of {', '.join(SIZES)}", "the model presets"),
    "embedding": (lambda v: v in EMBEDDINGS, f"one of {', '.join(EMBEDDINGS)}", "the three arms"),
    "dataset": (lambda v: v != "", "a name under data/", "what prepare_data.py wrote"),
    "total_tokens": (lambda v: v >= 1, ">= 1", "the training budget"),
    "batch_tokens": (lambda v: v >= 1, ">= 1", "tokens per optimizer step"),
    "micro_batch": (lambda v: v >= 1, ">= 1", "sequences per forward pass"),
    "lr": (lambda v: _finite(v) and v > 0, "> 0", "the peak learning rate"),
    "lr_input": (lambda v: _finite(v) and v > 0, "> 0", "a multiplier of --lr"),
    "lr_head": (lambda v: _finite(v) and v > 0, "> 0", "a multiplier of --lr"),
    "warmup_steps": (lambda v: v >= 0, ">= 0", "steps of linear warmup"),
    "min_lr_frac": (lambda v: _finite(v) and 0 <= v <= 1, "in [0, 1]", "the final fraction of --lr"),
    "weight_decay": (lambda v: _finite(v) and v >= 0, ">= 0", "a negative decay would grow the weights"),
    "beta1": (lambda v: _finite(v) and 0 <= v < 1, "in [0, 1)", "AdamW's first-moment decay"),
    "beta2": (lambda v: _finite(v) and 0 <= v < 1, "in [0, 1)", "AdamW's second-moment decay"),
    "grad_clip": (lambda v: _finite(v) and v > 0, "> 0", "the largest gradient norm"),
    "seed": (lambda v: 0 <= v < 2**63, "in [0, 2^63)", "a random seed"),
    "eval_interval": (lambda v: v >= 1, ">= 1", "steps between evaluations"),
    "eval_tokens": (lambda v: v >= 1, ">= 1", "validation tokens"),
    "log_interval": (lambda v: v >= 1, ">= 1", "steps between log lines"),
    "ckpt_interval": (lambda v: v >= 1, ">= 1", "steps between checkpoints"),
    "stop_step": (lambda v: v >= 0, ">= 0", "0 runs to the end"),
    "device": (lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda", "where to train"),
}


# Paper sizes follow the paper's v1 setup: 512 sequences of 512 tokens per step and ~20 tokens per
# parameter (the v2 budgets). The paper publishes no learning rate, warmup or weight decay; ours are
# the conservative GPT-3/Pythia values for these sizes (LEV's output is a product of 128 factors and
# spikes at too high a learning rate) with ~262M tokens of warmup (GPT-3 used 375M).
# micro_batch 16 fits an 80 GB GPU with room to spare (an estimate: ~33 GB at 1.2b, see the README);
# gradient accumulation fills the rest of the batch.
# tiny departs from 20 tokens/param (that would be ~45M tokens): 2.7M tokens (660 steps, ~3/4 of a
# pass over the demo corpus) take ~6.5 minutes at the ~7k tokens/s of a 2-core CPU. Its lr 3e-3 was
# checked smooth for all three arms; 1e-2 made LEV spike.
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
MODEL_FIELDS = [f.name for f in dataclasses.fields(Config) if f.name not in ("vocab_size", "embedding")]
# On --resume these may change freely; every other field changes the loss curve and must match.
RESUME_FREE = {"dataset", "data_dir", "out_dir", "micro_batch", "eval_interval", "eval_tokens", "log_interval",
               "ckpt_interval", "eval_only", "resume", "stop_step", "device", "compile", "bf16", "bf16_allreduce", "deterministic",
               "wandb_project", "wandb_run_name"}
# Learning-rate multipliers per arm (lr_input, lr_head), chosen by the CPU-scale study in the README
# (tiny preset, a short budget): the zero-initialised untied head wants 10-30x the backbone's rate,
# LEV a fraction of it. Not checked at the paper's sizes.
LR_SCALES = {"lev": dict(lr_input=0.3, lr_head=10.0), "tied": dict(lr_input=1.0, lr_head=1.0),
             "untied": dict(lr_input=1.0, lr_head=30.0)}
# Peak dense (not sparse) bf16 FLOP/s per GPU, from the vendors' data sheets, for MFU. Matched in
# order on torch.cuda.get_device_name(), so a variant comes before the plain name it contains.
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12),
              ("H200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12),
              ("A10", 125e12)]


class TrainError(Exception):
    """Bad input or a failed run; reported as one `error:` line on stderr."""


# ---------------------------------------------------------------------------- configuration

def parse_args(argv):
    """--key=value pairs -> {field: typed value}. Only the keys given: --resume needs to know them."""
    types_ = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    given = {}
    for arg in argv:
        if arg in ("-h", "--help"):  # the dataclass source is the most readable list of options
            print(__doc__ + "\nOptions (--name=value), with their defaults:\n")
            print("\n".join(inspect.getsource(TrainConfig).splitlines()[2:]))
            sys.exit(0)
        key, eq, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or key not in types_:
            raise TrainError(f"unknown option {arg!r}; valid options: {', '.join('--' + k for k in types_)}")
        kind = types_[key]
        if isinstance(kind, types.UnionType):  # `int | None`: parse as int
            kind = next(t for t in kind.__args__ if t is not type(None))
        given[key] = convert(key, kind, value if eq else "true")
    return given


def convert(key, kind, text):
    try:
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind is int:  # accept 262_144 and 4.2e9 (when whole)
            number = float(text.replace("_", ""))
            if number != int(number):
                raise ValueError
            return int(number)
        return kind(text.replace("_", "")) if kind is float else text
    except ValueError:
        raise TrainError(f"--{key}={text}: expected {kind.__name__}") from None


def resolve(given, saved=None):
    """The full TrainConfig: the options given over (the checkpoint's saved config, when resuming,
    or) the defaults of the chosen size."""
    if saved is not None:
        changed = {k for k, v in given.items() if k not in RESUME_FREE and saved.get(k) != v}
        if changed:
            raise TrainError("the checkpoint comes from a different config: " + ", ".join(
                f"{k}={saved.get(k)} there, {given[k]} here" for k in sorted(changed)) + "; use another --out_dir")
        try:
            return TrainConfig(**{**saved, **given})
        except TypeError as e:  # a checkpoint from another version of train.py
            raise TrainError(f"the checkpoint's train_config does not fit this train.py ({e})") from None
    tc = TrainConfig(**given)
    if tc.embedding == "tied" and tc.lr_head not in (None, 1.0):
        raise TrainError("--lr_head: the tied arm has no separate head (its table is the head); use --lr_input")
    defaults = {**SIZE_DEFAULTS[tc.size], **LR_SCALES[tc.embedding],
                **{k: getattr(SIZES[tc.size], k) for k in MODEL_FIELDS},
                "out_dir": os.path.join("out", f"{tc.size}-{tc.embedding}")}
    tc = dataclasses.replace(tc, **{k: v for k, v in defaults.items() if getattr(tc, k) in (None, "")})
    model_config(tc, {"vocab_size": SIZES[tc.size].vocab_size})  # the model's shape rules, before any work
    return tc


def model_config(tc, meta):
    try:
        return Config(vocab_size=padded_vocab(meta["vocab_size"]), embedding=tc.embedding,
                      **{k: getattr(tc, k) for k in MODEL_FIELDS})
    except ValueError as e:  # Config's own words, as an option: "lev_knots=1: ..." -> "--lev_knots=1: ..."
        raise TrainError(f"--{e}") from None


# ---------------------------------------------------------------------------- data

def open_data(tc):
    """meta.json, the shards of both splits (memory-mapped), and the training token counts."""
    data_dir = tc.data_dir or os.path.join("data", tc.dataset)
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        command = "python prepare_data.py" + ("" if tc.dataset == "pile" else f" --dataset={tc.dataset}")
        raise TrainError(f"no prepared data in {data_dir} (meta.json missing): run `{command}` first"
                         if not tc.data_dir else f"no prepared data in {data_dir} (meta.json missing)")
    meta = load_meta(data_dir)
    splits = {}
    for split in ("train", "val"):
        paths = shard_paths(data_dir, split)
        if not paths:
            raise TrainError(f"{data_dir} has no {split} shards; run prepare_data.py again")
        splits[split] = [read_shard(p) for p in paths]
        for path in paths:  # header[4]: the vocabulary the shard was tokenized with
            vocab = int(np.fromfile(path, "<i4", 5)[4])
            if vocab != meta["vocab_size"]:
                raise TrainError(f"{path} was made with a {vocab}-id tokenizer but {data_dir}/meta.json "
                                 f"says {meta['vocab_size']}: shards from another tokenizer; prepare the data again")
    if not os.path.isfile(os.path.join(data_dir, "counts.npy")):
        raise TrainError(f"{data_dir}/counts.npy is missing; run prepare_data.py again")
    counts = np.load(os.path.join(data_dir, "counts.npy"))
    return meta, splits, counts


class Windows:
    """Training sequences: windows of seq_len + 1 tokens starting every seq_len tokens inside each
    shard (each token is a target at most once per pass). Window number p of the run is drawn from
    a seeded per-epoch shuffle: the shards in a random order, each shard's windows in a random order.
    Two levels keep the memory small for a corpus of billions of tokens (the shards themselves are
    cut from a shuffled document stream), and window p is the same whatever the world size, so the
    data position is just the number of windows consumed."""

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
    out = []
    for s in shards:
        out += [s[i * seq_len:(i + 1) * seq_len + 1] for i in range((len(s) - 1) // seq_len)]
    return out[:n]


def to_batch(windows, device):
    xy = torch.from_numpy(np.stack(windows).astype(np.int64))
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


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
    """Rows {counts, tokens, loss, ppl} per bucket; loss and ppl are None for an empty bucket."""
    rows = []
    for j, (n, t) in enumerate(zip(nats, tokens)):
        label = "0" if j == 0 else f"{10 ** (j - 1)}-{10 ** j - 1}"
        loss = float(n / t) if t else None
        rows.append(dict(counts=label, tokens=int(t), loss=loss, ppl=math.exp(loss) if t else None))
    return rows


def frequency_table(losses, target_counts, n_buckets):
    """The paper's frequency-stratified analysis: validation perplexity per bucket of target-token
    training frequency, from per-token losses and the training counts of their targets."""
    return bucket_table(*bucket_sums(losses, target_counts, n_buckets))


# ---------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model, windows, run):
    """Loss, perplexity, bits per byte and the frequency table over the fixed validation windows.
    Every rank evaluates every world_size-th window; one all_reduce adds up the sums."""
    n_buckets = run.n_buckets
    nats, tokens, n_bytes = np.zeros(n_buckets), np.zeros(n_buckets), 0
    mine = windows[run.rank::run.world]
    for i in range(0, len(mine), run.tc.micro_batch):
        x, y = to_batch(mine[i:i + run.tc.micro_batch], run.device)
        with run.autocast:
            losses = model(x, y, reduction="none")
        targets = y.flatten().cpu().numpy()
        n, t = bucket_sums(losses.flatten().double().cpu().numpy(), run.counts[targets], n_buckets)
        nats, tokens, n_bytes = nats + n, tokens + t, n_bytes + int(run.byte_lengths[targets].sum())
    sums = torch.tensor(np.concatenate([nats, tokens, [n_bytes]]), dtype=torch.float64, device=run.device)
    if run.world > 1:
        dist.all_reduce(sums)
    nats, tokens, n_bytes = sums[:n_buckets].cpu().numpy(), sums[n_buckets:-1].cpu().numpy(), sums[-1].item()
    loss = nats.sum() / tokens.sum()
    return dict(val_loss=float(loss), val_ppl=math.exp(loss), val_bpb=float(nats.sum() / (math.log(2) * n_bytes)),
                eval_tokens=int(tokens.sum()), buckets=bucket_table(nats, tokens))


def report_eval(result, step, run):
    print(f"eval step {step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
          f"{result['val_bpb']:.4f} bits/byte | {result['eval_tokens']:,} tokens")
    print(f"  {'train count':>13} {'tokens':>10} {'loss':>8} {'ppl':>12}")
    for row in result["buckets"]:
        if row["tokens"]:
            print(f"  {row['counts']:>13} {row['tokens']:>10,} {row['loss']:>8.4f} {row['ppl']:>12.2f}")
    record = dict(step=step, tokens_seen=step * run.tc.batch_tokens, **result)
    write_json(os.path.join(run.tc.out_dir, f"eval_step{step}.json"), record)
    log_record(run, dict(type="eval", **{k: v for k, v in record.items() if k != "buckets"}))


# ---------------------------------------------------------------------------- checkpoints and logs

def log_record(run, record):
    with open(os.path.join(run.tc.out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if run.wandb:
        run.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])


def save_checkpoint(run, step):
    """Atomic and durable: write a temporary file, fsync it, rename it over ckpt.pt, fsync the folder.
    A kill or a full disk at any moment leaves the previous checkpoint or the new one, never half of
    one. Only rank 0 writes; the others wait at a barrier (see train)."""
    ckpt = dict(model=run.model.state_dict(), optimizer=run.optimizer.state_dict(),
                model_config=asdict(run.cfg), train_config=asdict(run.tc), data_meta=run.meta,
                step=step, tokens_seen=step * run.tc.batch_tokens, data_position=step * run.step_windows,
                rng_cpu=torch.get_rng_state(),
                rng_cuda=torch.cuda.get_rng_state() if run.device.type == "cuda" else torch.zeros(0, dtype=torch.uint8))
    path = os.path.join(run.tc.out_dir, "ckpt.pt")
    start = time.time()
    try:
        with open(path + ".tmp", "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except OSError as e:  # e.g. no space left: keep the previous checkpoint, remove the partial one
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise TrainError(f"could not write {path} ({e.strerror or e}); the previous checkpoint is kept") from None
    folder = os.open(run.tc.out_dir, os.O_RDONLY)
    try:
        os.fsync(folder)  # make the rename itself durable
    finally:
        os.close(folder)
    return os.path.getsize(path), time.time() - start


CKPT_KEYS = ("model", "optimizer", "model_config", "train_config", "data_meta", "step", "data_position", "rng_cpu")


def load_checkpoint(path):
    """Always onto the CPU, whatever device saved it: the RNG states must be CPU tensors, and each
    rank copies only the weights into its own GPU memory (load_state_dict) instead of holding a
    second full copy there. Memory-mapped, so ranks on one node share one copy in the page cache."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise TrainError(f"could not read {path} ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or not set(CKPT_KEYS) <= ckpt.keys():
        raise TrainError(f"{path} is not a train.py checkpoint (it lacks {', '.join(CKPT_KEYS)})")
    return ckpt


def check_checkpoint(ckpt, cfg, meta, path):
    here = asdict(cfg)
    if ckpt["model_config"] != here:
        diff = [f"{k}={ckpt['model_config'].get(k)} there, {here.get(k)} here"
                for k in sorted(here.keys() | ckpt["model_config"].keys()) if ckpt["model_config"].get(k) != here.get(k)]
        raise TrainError(f"{path} holds a different model ({', '.join(diff)}): a dataset with another "
                         "tokenizer or other model options; use the checkpoint's or another --out_dir")
    same = ("tokenizer", "tokenizer_vocab_size", "vocab_size", "eot_id")
    if any(ckpt["data_meta"].get(k) != meta.get(k) for k in same):
        raise TrainError(f"{path} was trained on data from another tokenizer ({ckpt['data_meta'].get('tokenizer')}, "
                         f"{ckpt['data_meta'].get('vocab_size')} ids) than this dataset ({meta.get('tokenizer')}, "
                         f"{meta.get('vocab_size')} ids)")


def keep_log_until(path, step):
    """On resume, drop log lines past the checkpoint (an interrupted run may have logged beyond it)."""
    if os.path.exists(path):  # a run killed mid-write leaves a partial last line: dropped too
        lines = [line for line in open(path) if line.endswith("\n") and json.loads(line)["step"] <= step]
        with open(path + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------- setup

class Run(types.SimpleNamespace):
    """Everything the loop needs, in one place."""


def setup_device(tc):
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    kind = tc.device if tc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device=cuda but no CUDA GPU is available; use --device=cpu")
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1 and "RANK" not in os.environ:
        raise TrainError("started as one of several SLURM tasks without torchrun: every task would train "
                         "alone into the same out_dir; launch with `srun torchrun ... train.py` (README)")
    if tc.deterministic:
        # cuBLAS needs a fixed workspace to repeat its reductions (set before its first use); the
        # flag then picks deterministic kernels everywhere, attention's backward included.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)) if kind == "cuda" else None)
    if kind == "cuda":
        # float32 matmuls stay exact (no TF32): under bf16 autocast the only ones left are LEV's,
        # whose product of 128 factors is why LEV runs in float32 at all.
        torch.cuda.set_device(device)
    else:
        # Denormal floats (e.g. tiny Adam moments late in training) are very slow on x86 CPUs.
        torch.set_flush_denormal(True)
    if world > 1 and not dist.is_initialized():
        # The timeout bounds any wait inside a collective, including the other ranks' wait while
        # rank 0 writes a checkpoint (~15 GB at 1.2b): NCCL's default of 10 minutes is too short
        # for a slow shared filesystem.
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", timeout=datetime.timedelta(minutes=60),
                                device_id=device if kind == "cuda" else None)
    return device, rank, world


def setup(argv):
    given = parse_args(argv)
    tc = resolve(given)  # also fixes the default out_dir
    path = os.path.join(given.get("out_dir") or tc.out_dir, "ckpt.pt")
    loading = tc.resume or tc.eval_only
    if loading and not os.path.exists(path):
        raise TrainError(f"no checkpoint {path} to {'resume' if tc.resume else 'evaluate'}; "
                         "train first (without --resume), or pass the run's --out_dir")
    if not loading and os.path.exists(path):
        raise TrainError(f"{path} exists: pass --resume to continue that run, or choose another --out_dir")
    device, rank, world = setup_device(tc)
    ckpt = load_checkpoint(path) if loading else None
    if ckpt is not None:
        tc = resolve(given, ckpt["train_config"])
    meta, splits, counts = open_data(tc)
    cfg = model_config(tc, meta)
    if ckpt is not None:
        check_checkpoint(ckpt, cfg, meta, path)
    per_step = world * tc.micro_batch * tc.seq_len
    if tc.batch_tokens % per_step:
        raise TrainError(f"batch_tokens={tc.batch_tokens:,} does not divide over world size {world} x micro_batch "
                         f"{tc.micro_batch} x seq_len {tc.seq_len} = {per_step:,}; use a multiple of it")
    if tc.total_tokens < tc.batch_tokens:
        raise TrainError(f"total_tokens={tc.total_tokens:,} is less than one step of batch_tokens={tc.batch_tokens:,}")
    train = Windows(splits["train"], tc.seq_len, tc.seed)
    val = val_windows(splits["val"], tc.seq_len, max(1, tc.eval_tokens // tc.seq_len))
    if train.total == 0 or not val:
        raise TrainError(f"the data is shorter than one window of seq_len + 1 = {tc.seq_len + 1} tokens")
    if tc.wandb_project and rank == 0:
        try:
            import wandb  # noqa: F401  (checked now, started once the run folder exists)
        except ImportError:
            raise TrainError("--wandb_project needs wandb: pip install wandb") from None
    if rank == 0:  # the last check: the run folder is made only once everything else is right
        try:
            os.makedirs(tc.out_dir, exist_ok=True)
        except OSError as e:
            raise TrainError(f"--out_dir={tc.out_dir}: cannot create it ({e.strerror})") from None
    return Run(tc=tc, cfg=cfg, meta=meta, counts=counts, ckpt=ckpt, train=train, val=val, device=device,
               rank=rank, world=world, accum=tc.batch_tokens // per_step, step_windows=tc.batch_tokens // tc.seq_len,
               max_steps=tc.total_tokens // tc.batch_tokens, wandb=None,
               byte_lengths=tokenizer_from_meta(meta).token_byte_lengths(),
               # count 0, then as many decades (1-9, 10-99, ...) as the most frequent token needs
               n_buckets=1 + len(str(max(1, int(counts.max())))))


def make_optimizer(model, tc, device):
    # AdamW with weight decay on the backbone and head matrices only: norms are scales, and the
    # input side (LEV, the untied table) is left alone, since decay would shrink LEV's product of 128
    # factors exponentially and erase a rare token's row between its few gradients. In the tied arm
    # the shared table is also the head, so it is decayed. (Model.configure_optimizers.)
    return model.configure_optimizers(tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), fused=device.type == "cuda",
                                      lr_input=tc.lr_input, lr_head=tc.lr_head)


def lr_at(step, tc, max_steps):
    """Linear warmup to lr, then cosine decay to min_lr_frac * lr at the last step."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = (step - tc.warmup_steps) / max(1, max_steps - tc.warmup_steps)
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---------------------------------------------------------------------------- training

STOP = {"signal": None}


def on_signal(signum, frame):
    # Only note it: the step in flight finishes and is checkpointed by train(). A second Ctrl-C
    # leaves at once (the last checkpoint stays); a later SIGTERM (torchrun passes one on after a
    # Ctrl-C) is ignored so that the save can finish.
    if STOP["signal"] is not None:
        if signum == signal.SIGINT == STOP["signal"]:
            raise SystemExit(128 + signum)
        return
    STOP["signal"] = signum
    print(f"\n{signal.Signals(signum).name}: saving a checkpoint at the end of this step", flush=True)


# SIGTERM: torchrun, Kubernetes and SLURM's end of job; SIGUSR1: SLURM's `--signal` warning before the
# time limit. Both are a preemption: save and exit, with no evaluation in between.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def train_step(run, step, position):
    """One optimizer step over batch_tokens. Rank r's micro-step m takes the fixed slice
    (r * accum + m) of the step's windows, so the batch is the same for any world size."""
    for group in run.optimizer.param_groups:  # each group's lr_scale: see Model.configure_optimizers
        group["lr"] = lr_at(step, run.tc, run.max_steps) * group["lr_scale"]
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = position + (run.rank * run.accum + micro) * run.tc.micro_batch
        x, y = to_batch([run.train[p] for p in range(first, first + run.tc.micro_batch)], run.device)
        last = micro == run.accum - 1  # all-reduce the gradients once, after the last micro-step
        with run.autocast, (run.ddp.no_sync() if run.ddp and not last else nullcontext()):
            loss = run.step_model(x, y)
        (loss / run.accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.tc.grad_clip)
    # One all_reduce for the mean loss and "did any rank get a signal", so all ranks stop together.
    shared = torch.stack([loss_sum / run.accum, torch.tensor(float(STOP["signal"] is not None), device=run.device)])
    if run.world > 1:
        dist.all_reduce(shared)
    loss, stop, grad_norm = shared[0].item() / run.world, shared[1].item() > 0, grad_norm.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainError(f"non-finite loss ({loss}) or gradient norm at step {step + 1}: stopped without updating; "
                         "the last good checkpoint is kept (try a lower --lr)")
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, stop


def log_step(run, step, loss, grad_norm, seconds, steps_done):
    tokens_per_s = steps_done * run.tc.batch_tokens / seconds
    eta = (run.max_steps - step) * seconds / steps_done
    record = dict(type="train", step=step, loss=loss, lr=lr_at(step - 1, run.tc, run.max_steps), grad_norm=grad_norm,
                  tokens_seen=step * run.tc.batch_tokens, tokens_per_s=tokens_per_s, eta_s=eta)
    line = (f"step {step}/{run.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e} | "
            f"{tokens_per_s:,.0f} tok/s")
    if run.peak_flops:
        record["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_flops * run.world)
        line += f" | MFU {100 * record['mfu']:.1f}%"
    if run.device.type == "cuda":
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
        line += f" | peak mem {record['peak_mem_gb']:.1f} GB"
    print(line + f" | ETA {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}", flush=True)
    log_record(run, record)


def checkpoint(run, step):
    """Rank 0 writes; the broadcast of its outcome is also the barrier at which the other ranks
    wait meanwhile, and it stops every rank alike if the write failed (a full disk)."""
    error = None
    if run.rank == 0:
        try:
            size, seconds = save_checkpoint(run, step)
            print(f"checkpoint: step {step}, {size / 1e9:.2f} GB in {seconds:.1f} s", flush=True)
        except TrainError as e:
            error = e
    if run.world > 1:
        saved = torch.tensor(float(error is None), device=run.device)
        dist.broadcast(saved, 0)
        if not saved.item() and error is None:
            error = TrainError("rank 0 could not write the checkpoint")
    if error is not None:
        raise error


def train(run):
    tc, step, position = run.tc, run.start_step, run.start_position
    if step >= run.max_steps:
        print(f"the run is complete ({step} steps); nothing to do")
        return 0
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    t0, steps_timed = time.time(), 0
    while step < run.max_steps:
        loss, grad_norm, stop = train_step(run, step, position)
        step, position, steps_timed = step + 1, position + run.step_windows, steps_timed + 1
        preempted = stop  # a signal reached some rank: save as fast as possible
        stop = stop or step == tc.stop_step
        if run.rank == 0 and (step % tc.log_interval == 0 or step == run.max_steps or stop):
            log_step(run, step, loss, grad_norm, time.time() - t0, steps_timed)
            t0, steps_timed = time.time(), 0
        if (step % tc.eval_interval == 0 or step == run.max_steps) and not preempted:
            result = evaluate(run.eval_model, run.val, run)
            if run.rank == 0:
                report_eval(result, step, run)
            t0, steps_timed = time.time(), 0  # tokens/s counts training only
        if step % tc.ckpt_interval == 0 or step == run.max_steps or stop:
            checkpoint(run, step)
        if stop:
            why = signal.Signals(STOP["signal"]).name if STOP["signal"] else f"--stop_step={tc.stop_step}"
            if run.rank == 0:
                print(f"stopped at step {step} ({why}); checkpoint saved: continue with the same command plus --resume")
            return 128 + STOP["signal"] if STOP["signal"] else 0
    if run.rank == 0:
        print(f"done: {step} steps, {step * tc.batch_tokens:,} tokens; checkpoint {tc.out_dir}/ckpt.pt")
    return 0


def failed_rank(error):
    """The lowest rank whose set-up failed, or None. A set-up error can hit one rank only (a file
    missing on one node): every rank learns of it here, so all stop instead of waiting for the
    failed one inside the next collective."""
    if not dist.is_initialized():
        return 0 if error is not None else None  # every rank fails alike before the process group
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    lowest = torch.tensor(dist.get_rank() if error is not None else dist.get_world_size(), device=device)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return None if lowest.item() == dist.get_world_size() else int(lowest.item())


def bf16_allreduce_hook(group, bucket):
    """DDP communication hook: average a bucket of float32 gradients as bf16, half the bytes on the
    wire. (torch's own bf16 hook insists on NCCL; this one also runs under gloo, so it is tested.)"""
    group = group or dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())

    def decompress(future):
        return bucket.buffer().copy_(future.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def build(run):
    """The model and optimizer, restored from the checkpoint when resuming, then compiled and
    wrapped: run.model is the plain module (saved, counted), run.eval_model its compiled form, and
    run.step_model the form that trains (DDP around the compiled model when there are several ranks)."""
    tc, cuda = run.tc, run.device.type == "cuda"
    torch.manual_seed(tc.seed)
    run.model = Model(run.cfg).to(run.device)
    run.optimizer = make_optimizer(run.model, tc, run.device)
    run.start_step = run.start_position = 0
    if run.ckpt is not None:
        run.model.load_state_dict(run.ckpt["model"])
        run.optimizer.load_state_dict(run.ckpt["optimizer"])  # moves the moments onto the parameters' device
        torch.set_rng_state(run.ckpt["rng_cpu"])
        if cuda and run.ckpt["rng_cuda"].numel():
            torch.cuda.set_rng_state(run.ckpt["rng_cuda"])
        run.start_step, run.start_position = run.ckpt["step"], run.ckpt["data_position"]
        run.ckpt = None  # nothing else is needed: let the full state dict go
    bf16 = tc.bf16 if tc.bf16 is not None else cuda
    run.autocast = torch.autocast(run.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    run.eval_model = run.model
    if tc.compile if tc.compile is not None else cuda:
        if run.cfg.embedding == "lev":
            run.model.lev.compile_generator()  # LEV's torch.unique stays outside the graph
        run.eval_model = torch.compile(run.model)
    run.ddp, run.step_model = None, run.eval_model
    if run.world > 1:
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets, no second copy.
        run.ddp = torch.nn.parallel.DistributedDataParallel(run.eval_model, device_ids=[run.device] if cuda else None,
                                                            gradient_as_bucket_view=True)
        if tc.bf16_allreduce:
            run.ddp.register_comm_hook(None, bf16_allreduce_hook)
        run.step_model = run.ddp
    name = torch.cuda.get_device_name(run.device) if cuda else ""
    run.peak_flops = next((flops for key, flops in PEAK_FLOPS if key in name), None)
    run.flops_per_token = run.model.flops_per_token()


def start_outputs(run):
    """Rank 0: print the config, write config.json, trim the log to the checkpoint, start wandb."""
    tc, cfg = run.tc, run.cfg
    counts = run.model.param_counts()
    print(f"config: {json.dumps(asdict(tc))}\nmodel: {json.dumps(asdict(cfg))}")
    print(f"parameters: {', '.join(f'{k} {v:,}' for k, v in counts.items())}; "
          f"{run.world} x {run.device.type}, {run.accum} micro-steps of {tc.micro_batch} x {tc.seq_len} per step")
    if not tc.eval_only:
        write_json(os.path.join(tc.out_dir, "config.json"), dict(train=asdict(tc), model=asdict(cfg)))
        # a resumed run keeps its log up to the checkpoint; a new run starts a new log
        keep_log_until(os.path.join(tc.out_dir, "log.jsonl"), run.start_step)
    if tc.wandb_project:
        import wandb
        run.wandb = wandb.init(project=tc.wandb_project, name=tc.wandb_run_name or None, resume="allow",
                               config=dict(train=asdict(tc), model=asdict(cfg), params=counts))


def shutdown(code):
    if dist.is_initialized():
        dist.barrier()  # every rank has finished (and rank 0 has written its checkpoint)
        if dist.get_backend() == "gloo":
            # Tearing down gloo can deadlock on the GIL while its threads release Python-owned
            # tensors (pytorch#56297; seen here in ~1 of 6 CPU runs, after all work was done), so
            # a gloo rank leaves without the teardown: everything it wrote is already flushed.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        dist.destroy_process_group()
    return code


def main(argv):
    rank = int(os.environ.get("RANK", 0))
    run, error = None, None
    try:
        run = setup(argv)
    except (TrainError, ShardError) as e:
        error = e
    lowest = failed_rank(error)
    if lowest is not None:
        if rank == lowest:  # one error line for the whole job
            print_error(error)
        return shutdown(1)
    build(run)
    if run.rank == 0:
        start_outputs(run)
    try:
        if run.tc.eval_only:
            result = evaluate(run.eval_model, run.val, run)
            if run.rank == 0:
                report_eval(result, run.start_step, run)
            code = 0
        else:
            code = train(run)
    except TrainError as e:  # raised on every rank alike (the loss and the checkpoint outcome are shared)
        if run.rank == 0:
            print_error(e)
        code = 1
    return shutdown(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
