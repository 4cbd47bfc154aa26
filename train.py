"""Train a Leviathan model (or one of its two baselines) on token shards from prepare_data.py.

    python train.py --size=tiny                                # CPU, a few minutes (data/demo)
    python train.py --size=200m --embedding=tied               # one GPU (data/pile)
    torchrun --nproc_per_node=8 train.py --size=1.2b           # DDP; add --nnodes/--rdzv_* for several nodes
    python train.py --size=200m --resume                       # continue out/200m-lev exactly
    python train.py --size=200m --eval_only                    # evaluate its checkpoint

Every field of TrainConfig is an option, --name=value (a bare --flag means true); one left at None
takes the value of the chosen --size (SIZES). `python train.py --help` lists them all.

Read top to bottom, in the order a run meets them: the sizes, the options, the set-up (device,
DDP, data), where every check that can refuse a run comes before any work; the model and
optimizer; main, with the loop; one step; the evaluation; checkpoints and preemption signals.
"""
import argparse, dataclasses, datetime, inspect, json, math, os, re, signal, sys, threading, time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

try:
    import fcntl  # POSIX: the run folder's lock (lock_run_folder); on Windows folders go unlocked
except ImportError:
    fcntl = None

from leviathan import EMBEDDINGS, Config, Model, distinct_ids, padded_vocab
from prepare_data import (ArgumentParser, UserError, atomic_write, load_counts, load_meta, parse_bool, parse_number,
                          print_error, read_shard, run_main, shard_paths, tokenizer_from_meta, write_json)
from sample import load_checkpoint, precision

# ---------------------------------------------------------------------------- the sizes


@dataclass(frozen=True)
class Preset:
    model: Config  # the shape; vocab_size is the tokenizer's (data/<name>/meta.json)
    data_dir: str  # what prepare_data.py wrote
    total_tokens: int  # the training budget
    batch_tokens: int  # tokens per optimizer step
    micro_batch: int  # sequences per GPU per forward pass
    lr: float  # the backbone's peak AdamW rate
    warmup_steps: int
    eval_interval: int  # steps
    eval_tokens: int
    ckpt_interval: int  # steps
    lr_scales: dict  # arm -> (lr_input, lr_head), multipliers of lr (Model.configure_optimizers)


# The paper's sizes: its v1 batch (512 x 512 tokens) and v2 budgets (~20 tokens per parameter).
# Learning rate, warmup and decay, which it does not publish, are conservative GPT-3/Pythia
# values (LEV's product spikes at too high a rate). One shape rule: heads of 128 dims, SwiGLU of
# 8/3 D, and the depth that brings the *tied* model (embedding included, as the paper counts)
# closest to its nominal size with o200k_base. D = 2048 at 1.2B is the paper's; it publishes no
# other width and no depth, so 768 and 1024 are the usual GPT-2/LLaMA widths. The o200k table
# is 154M of the 200M model, which leaves it 7 layers.
#   200m: 203.2M tied   400m: 397.6M tied   1.2b: 1.219B tied (tests/test_train.py checks)
# The multipliers (lr_input, lr_head) come from the CPU-scale study's width sweep
# (experiments/study.md): at D = 128 its best; at the paper's widths the power laws fitted there,
# extrapolated. Zero-initialised heads and the tied table want far more than the backbone's rate,
# LEV a tenth of it.
PAPER = dict(data_dir="data/pile", batch_tokens=512 * 512, micro_batch=16, warmup_steps=1000,
             eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000)
SIZES = {
    # tiny: minutes on a 2-core CPU on the demo corpus (8,192-id vocabulary), 660 steps; lr 3e-3
    # trains all three arms smoothly (1e-2 made LEV spike). Heads of 32 dims, as 128-dim heads
    # would leave a 128-wide model one head. LEV keeps d_seed = 128 and kappa = 16 but has
    # h * r = D modes (h=4, r=32) instead of the paper's 512: at D = 128 the paper's LEV would
    # cost more per distinct id than the whole backbone costs per token.
    "tiny": Preset(Config(vocab_size=8192, d_model=128, n_layer=4, n_head=4, seq_len=256, lev_heads=4, lev_rank=32),
                   data_dir="data/demo", total_tokens=2_703_360, batch_tokens=16 * 256, micro_batch=16, lr=3e-3,
                   warmup_steps=30, eval_interval=200, eval_tokens=1 << 16, ckpt_interval=200,
                   lr_scales={"lev": (0.1, 30.0), "tied": (30.0, 1.0), "untied": (1.0, 30.0)}),
    "200m": Preset(Config(d_model=768, n_layer=7, n_head=6), total_tokens=4_200_000_000, lr=6e-4,
                   lr_scales={"lev": (0.1, 8.2), "tied": (13.0, 1.0), "untied": (1.0, 8.8)}, **PAPER),
    "400m": Preset(Config(d_model=1024, n_layer=15, n_head=8), total_tokens=8_400_000_000, lr=3e-4,
                   lr_scales={"lev": (0.1, 6.6), "tied": (12.0, 1.0), "untied": (1.0, 7.2)}, **PAPER),
    "1.2b": Preset(Config(d_model=2048, n_layer=16, n_head=16), total_tokens=24_100_000_000, lr=2e-4,
                   lr_scales={"lev": (0.1, 4.0), "tied": (10.0, 1.0), "untied": (1.0, 4.6)}, **PAPER),
}

# ---------------------------------------------------------------------------- the options


def one_of(names, what):
    return (lambda v: v in names), f"one of {', '.join(names)} ({what})"


def at_least(least, why=""):
    return (lambda v: math.isfinite(v) and v >= least), f">= {least}{why}"


def positive():
    return (lambda v: math.isfinite(v) and v > 0), "> 0"


def within(low, high, why, closed=True):
    return ((lambda v: math.isfinite(v) and low <= v <= high) if closed else
            (lambda v: math.isfinite(v) and low <= v < high)), f"in [{low}, {high}{']' if closed else ')'} ({why})"


def option(default, help, rule=None):
    """A TrainConfig field: its default, its --help, and the rule a given value must follow."""
    return field(default=default, metadata=dict(help=help, rule=rule))


@dataclass
class TrainConfig:
    # what to train, on what
    size: str = option("tiny", "the model and its defaults", one_of(SIZES, "SIZES"))
    embedding: str = option("lev", "lev (Leviathan) | tied (the paper's baseline) | untied (ablation)",
                            one_of(EMBEDDINGS, "the three arms"))
    data_dir: str | None = option(None, "a folder prepare_data.py wrote; None: the size's (data/demo, data/pile)")
    out_dir: str = option("", "the run folder (default out/<size>-<embedding>)")
    # model shape: None keeps the size's (vocab_size always comes from the data); leviathan.Config checks them
    d_model: int | None = option(None, "model width D")
    n_layer: int | None = option(None, "Transformer blocks")
    n_head: int | None = option(None, "attention heads")
    seq_len: int | None = option(None, "tokens per training sequence (the context)")
    rope_theta: float | None = option(None, "rotary base")
    lev_digits: int | None = option(None, "LEV: k, digits per id")
    lev_seed_dim: int | None = option(None, "LEV: d_seed, the seed's width")
    lev_heads: int | None = option(None, "LEV: h heads")
    lev_knots: int | None = option(None, "LEV: kappa, B-spline knots")
    lev_rank: int | None = option(None, "LEV: r, modes per head")
    lev_sigmoid_scale: float | None = option(None, "LEV: t = sigmoid(scale * u), (R) 1/2; 1 as in the study's first part")
    # budget, batch and optimiser
    total_tokens: int | None = option(None, "training tokens; steps = total_tokens // batch_tokens", at_least(1))
    batch_tokens: int | None = option(None, "tokens per optimizer step over all GPUs (whatever the world size)",
                                      at_least(1))
    micro_batch: int | None = option(None, "sequences per GPU per forward pass; accumulation fills the rest",
                                     at_least(1))
    lr: float | None = option(None, "peak learning rate of the backbone", positive())
    lr_input: float | None = option(None, "x lr for the input side (LEV, or the table); None: the size's", positive())
    lr_head: float | None = option(None, "x lr for the untied head (lev, untied); None: the size's", positive())
    warmup_steps: int | None = option(None, "steps of linear warmup", at_least(0))
    min_lr_frac: float = option(0.1, "cosine decay ends at min_lr_frac * lr", within(0, 1, "a fraction of --lr"))
    weight_decay: float = option(0.1, "on the backbone and head matrices only",
                                 at_least(0, " (a negative decay would grow the weights)"))
    beta1: float = option(0.9, "AdamW's first-moment decay", within(0, 1, "a decay", closed=False))
    beta2: float = option(0.95, "AdamW's second-moment decay", within(0, 1, "a decay", closed=False))
    grad_clip: float = option(1.0, "largest gradient norm", positive())
    seed: int = option(1337, "model init and data order", within(0, 2**63, "a seed", closed=False))
    # evaluation, logging, checkpoints
    eval_interval: int | None = option(None, "steps between evaluations (and one at the end)", at_least(1))
    eval_tokens: int | None = option(None, "validation tokens evaluated (the first of the val split)", at_least(1))
    log_interval: int = option(10, "steps between log lines", at_least(1))
    ckpt_interval: int | None = option(None, "steps between checkpoints (and one at the end)", at_least(1))
    eval_only: bool = option(False, "evaluate out_dir/ckpt.pt and exit")
    resume: bool = option(False, "continue from out_dir/ckpt.pt")
    stop_step: int = option(0, "save and exit after this step, schedule unchanged (0: run to the end)", at_least(0))
    # hardware
    device: str = option("auto", "where to train", one_of(("auto", "cpu", "cuda"), "cuda if there is a GPU"))
    compile: bool | None = option(None, "torch.compile; None: on for CUDA, off for CPU")
    bf16: bool | None = option(None, "bf16 autocast of the backbone and the head's matmuls (LEV and the "
                                     "softmax stay float32); None: on for CUDA, off for CPU")
    bf16_allreduce: bool = option(False, "DDP: all-reduce gradients in bf16, half the traffic (for several nodes)")
    deterministic: bool = option(False, "deterministic kernels: bit-identical reruns and resumes (CUDA: slower)")
    wandb_project: str = option("", "log to Weights & Biases (needs `pip install wandb`)")
    wandb_run_name: str = option("", "the run's name there")

    def __post_init__(self):
        """The one check of every option's range; None means "from the size" and is checked once
        resolve() has filled it in. The model's shape is leviathan.Config's to check."""
        for f in dataclasses.fields(self):
            value, rule = getattr(self, f.name), f.metadata["rule"]
            if value is not None and rule is not None and not rule[0](value):
                raise UserError(f"--{f.name}={value}: must be {rule[1]}")
        if self.wandb_run_name and not self.wandb_project:
            raise UserError("--wandb_run_name needs --wandb_project")
        if self.embedding == "tied" and self.lr_head not in (None, 1.0):
            raise UserError("--lr_head: the tied arm has no separate head (its table is the head); use --lr_input")


MODEL_FIELDS = [f.name for f in dataclasses.fields(Config) if f.name not in ("vocab_size", "embedding")]
TRAIN_FIELDS = [f.name for f in dataclasses.fields(Preset) if f.name not in ("model", "lr_scales")]  # the preset's rest
# On --resume these may change freely; every other field changes the loss curve and must match.
RESUME_FREE = {"data_dir", "out_dir", "micro_batch", "eval_interval", "eval_tokens", "log_interval", "ckpt_interval",
               "eval_only", "resume", "stop_step", "device", "compile", "bf16", "bf16_allreduce", "deterministic",
               "wandb_project", "wandb_run_name"}


def parse_args(argv):
    """--name=value options -> {field: value} for the fields given (--resume must know which)."""
    parser = ArgumentParser("train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        kind = next(t for t in getattr(f.type, "__args__", [f.type]) if t is not type(None))
        shown = "" if f.default in (None, "") else f" (default: {f.default})"
        how = dict(type=parse_bool, nargs="?", const=True) if kind is bool else dict(
            type=parse_number(kind) if kind in (int, float) else str)
        parser.add_argument(f"--{f.name}", default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                            help=(f.metadata["help"] + shown).replace("%", "%%"), **how)
    return vars(parser.parse_args(argv))


def resolve(given, saved=None):
    """The full TrainConfig: the options given over (the checkpoint's saved config, when resuming,
    or) the defaults of the chosen size."""
    if saved is not None:
        changed = {k for k, v in given.items() if k not in RESUME_FREE and saved.get(k) != v}
        if changed:
            raise UserError("the checkpoint comes from a different config: " + ", ".join(
                f"{k}={saved.get(k)} there, {given[k]} here" for k in sorted(changed)) + "; use another --out_dir")
        try:
            return TrainConfig(**{**saved, **given})
        except TypeError as e:  # a checkpoint from another version of train.py
            raise UserError(f"the checkpoint's train_config does not fit this train.py ({e})") from None
    config = TrainConfig(**given)
    preset = SIZES[config.size]
    lr_input, lr_head = preset.lr_scales[config.embedding]
    defaults = {**{k: getattr(preset, k) for k in TRAIN_FIELDS}, "lr_input": lr_input, "lr_head": lr_head,
                **{k: getattr(preset.model, k) for k in MODEL_FIELDS},
                "out_dir": os.path.join("out", f"{config.size}-{config.embedding}")}
    config = TrainConfig(**{**asdict(config), **{k: v for k, v in defaults.items() if getattr(config, k) in (None, "")}})
    model_config(config, {"vocab_size": preset.model.vocab_size})  # the model's shape rules, before any work
    return config


def model_config(config, meta):
    try:
        return Config(vocab_size=padded_vocab(meta["vocab_size"]), embedding=config.embedding,
                      **{k: getattr(config, k) for k in MODEL_FIELDS})
    except ValueError as e:  # Config's own words, as an option: "lev_knots=1: ..." -> "--lev_knots=1: ..."
        raise UserError(f"--{e}") from None


# ---------------------------------------------------------------------------- set-up: device, DDP, data


@dataclass
class Run:
    """Everything the loop needs. raw_model is the plain module (saved, counted, optimised);
    model is the form that runs it: compiled, and wrapped in DDP across ranks."""
    config: TrainConfig
    model_config: Config
    meta: dict  # the data folder's meta.json
    counts: np.ndarray  # each token id's count in the train split: the frequency buckets
    byte_lengths: np.ndarray  # UTF-8 bytes per id: bits per byte
    train: "Windows"
    val: list  # the fixed validation windows
    ckpt: dict | None  # the checkpoint resumed from, until build() has restored it
    lock: int | None  # rank 0: the run folder's locked descriptor (lock_run_folder)
    device: torch.device
    rank: int
    world: int
    accum: int  # micro-steps per optimizer step on each rank
    step_windows: int  # windows per optimizer step, over all ranks
    max_steps: int
    step: int = 0  # optimizer steps done
    raw_model: Model | None = None
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    autocast: object = nullcontext()
    compiled: bool = False
    writer: "CheckpointWriter | None" = None
    wandb: object = None
    peak_flops: float | None = None  # per GPU, for MFU

    @property
    def position(self):
        """Windows consumed: the data position of step `step`, the same for any world size."""
        return self.step * self.step_windows

    @property
    def lev(self):
        """Whether batches carry LEV's distinct ids (to_batch)."""
        return self.model_config.embedding == "lev"

    @property
    def n_buckets(self):
        """Frequency buckets: count 0, then as many decades (1-9, 10-99, ...) as the most frequent token needs."""
        return 1 + len(str(max(1, int(self.counts.max()))))


def setup_device(config):
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    kind = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda but no CUDA GPU is available; use --device=cpu")
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1 and "RANK" not in os.environ:
        raise UserError("started as one of several SLURM tasks without torchrun: every task would train "
                        "alone into the same out_dir; launch with `srun torchrun ... train.py` (README)")
    if config.deterministic:
        # cuBLAS needs a fixed workspace to repeat its reductions (set before its first use); the
        # flag then picks deterministic kernels everywhere, attention's backward included.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)) if kind == "cuda" else None)
    if kind == "cuda":
        # TF32 stays off: under bf16 autocast the only float32 matmuls left are LEV's, whose product
        # of 128 factors is why LEV runs in float32 at all.
        torch.cuda.set_device(device)
    else:
        torch.set_flush_denormal(True)  # denormal floats (tiny Adam moments late in training) are slow on x86
    if world > 1 and not dist.is_initialized():
        # The timeout bounds every wait in a collective, including the other ranks' wait while rank 0
        # writes a checkpoint (~15 GB at 1.2b): NCCL's default 10 minutes is short for a slow filesystem.
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", timeout=datetime.timedelta(minutes=60),
                                device_id=device if kind == "cuda" else None)
    return device, rank, world


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


def prepare_command(data_dir):
    """How to make a size's default data folder, or None for a folder the user named."""
    return {"data/demo": "python prepare_data.py --dataset=demo", "data/pile": "python prepare_data.py"}.get(
        os.path.normpath(data_dir).replace(os.sep, "/"))


def open_data(data_dir):
    """meta.json, the shards of both splits (memory-mapped), and the training token counts."""
    if not os.path.isfile(os.path.join(data_dir, "meta.json")):
        command = prepare_command(data_dir)
        raise UserError(f"no prepared data in {data_dir} (meta.json missing): " + (
            f"run `{command}` first" if command else "pass --data_dir=DIR, the --out_dir prepare_data.py wrote"))
    meta = load_meta(data_dir)
    splits = {}
    for split in ("train", "val"):
        paths = shard_paths(data_dir, split)
        if not paths:
            raise UserError(f"{data_dir} has no {split} shards; run prepare_data.py again")
        splits[split] = [read_shard(path, meta["vocab_size"]) for path in paths]
    return meta, splits, load_counts(data_dir, meta["vocab_size"])


class Windows:
    """Training sequences: windows of seq_len + 1 tokens starting every seq_len tokens inside each
    shard (each token is a target at most once per pass). Window p of the run comes from a seeded
    shuffle per epoch at two levels, the shards then each shard's windows: little memory for
    billions of tokens, and window p is the same whatever the world size, so the data position
    is just the number of windows consumed."""

    def __init__(self, shards, seq_len, seed, vocab_size):
        self.shards, self.seq_len, self.seed, self.vocab_size = shards, seq_len, seed, vocab_size
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
        return checked_window(self.shards[self.shard_order[k]], start, self.seq_len, self.vocab_size)


def val_windows(shards, seq_len, n, vocab_size):
    """The first n windows of the validation split, in order: the same tokens at every evaluation."""
    starts = [(s, i * seq_len) for s in shards for i in range((len(s) - 1) // seq_len)][:n]
    return [checked_window(s, start, seq_len, vocab_size) for s, start in starts]


def checked_window(shard, start, seq_len, vocab_size):
    """shard[start:start + seq_len + 1], refused if it holds an id past the vocabulary. A shard's
    header can be intact over damaged tokens, and such an id would crash a step (or, for LEV, whose
    digits take any integer, quietly train on a padding row). Checking as windows are read costs a
    pass over a few MB per step, where checking whole shards at start would read the corpus."""
    window = shard[start:start + seq_len + 1]
    if window.max() >= vocab_size:
        at = start + int(np.argmax(window >= vocab_size))
        raise UserError(f"{shard.filename}: token {at:,} is id {int(shard[at])}, beyond the vocabulary of "
                        f"{vocab_size:,} (damaged contents under an intact header); prepare the data again")
    return window


def open_run(argv):
    """Every check that can refuse the run, in order, before anything is written; then the Run."""
    given = parse_args(argv)
    config = resolve(given)  # also fixes the default out_dir
    path = os.path.join(given.get("out_dir") or config.out_dir, "ckpt.pt")
    loading = config.resume or config.eval_only
    if loading and not os.path.exists(path):
        raise UserError(f"no checkpoint {path} to {'resume' if config.resume else 'evaluate'}; train first (without "
                        f"--{'resume' if config.resume else 'eval_only'}), or pass the run's --out_dir")
    if not loading and os.path.exists(path):
        raise UserError(f"{path} exists: pass --resume to continue that run, or choose another --out_dir")
    device, rank, world = setup_device(config)
    ckpt = load_checkpoint(path, ("model", "optimizer", "model_config", "train_config", "data_meta",
                                  "step")) if loading else None
    if ckpt is not None:
        config = resolve(given, ckpt["train_config"])
    meta, splits, counts = open_data(config.data_dir)
    model_cfg = model_config(config, meta)
    if ckpt is not None:
        check_checkpoint(ckpt, model_cfg, meta, path)
    if config.resume:  # the log it continues: damaged, refused before anything is written
        read_log(os.path.join(os.path.dirname(path), "log.jsonl"))
    per_step = world * config.micro_batch * config.seq_len
    if config.batch_tokens % per_step:
        raise UserError(f"batch_tokens={config.batch_tokens:,} does not divide over world size {world} x micro_batch "
                        f"{config.micro_batch} x seq_len {config.seq_len} = {per_step:,}; use a multiple of it")
    if config.total_tokens < config.batch_tokens:
        raise UserError(f"total_tokens={config.total_tokens:,} is less than one step of "
                        f"batch_tokens={config.batch_tokens:,}")
    train = Windows(splits["train"], config.seq_len, config.seed, meta["vocab_size"])
    val = val_windows(splits["val"], config.seq_len, max(1, config.eval_tokens // config.seq_len), meta["vocab_size"])
    if train.total == 0 or not val:
        raise UserError(f"the data is shorter than one window of seq_len + 1 = {config.seq_len + 1} tokens")
    if config.wandb_project and rank == 0:
        try:
            import wandb  # noqa: F401  (checked now, started once the run folder exists)
        except ImportError:
            raise UserError("--wandb_project needs wandb: pip install wandb") from None
    lock = None
    if rank == 0:  # the last checks: the run folder is made only once everything else is right
        try:
            os.makedirs(config.out_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out_dir={config.out_dir}: cannot create it ({e.strerror})") from None
        lock = lock_run_folder(config.out_dir)
    return Run(config=config, model_config=model_cfg, meta=meta, counts=counts, lock=lock,
               byte_lengths=tokenizer_from_meta(meta).token_byte_lengths(), train=train, val=val, ckpt=ckpt,
               device=device, rank=rank, world=world, accum=config.batch_tokens // per_step,
               step_windows=config.batch_tokens // config.seq_len, max_steps=config.total_tokens // config.batch_tokens)


def lock_run_folder(out_dir):
    """One train.py at a time per run folder: an exclusive lock on the folder itself (nothing is
    written), held by rank 0 until the run ends; the kernel drops it when a process dies, so a
    crashed run leaves none behind. Returns the locked descriptor (None where the filesystem has
    no locks, as some cluster filesystems do: the folder then goes unlocked)."""
    if fcntl is None:
        return None
    folder = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(folder)
        raise UserError(f"another train.py is running in {out_dir}: let it finish (or stop it), or choose "
                        "another --out_dir") from None
    except OSError:
        os.close(folder)
        return None
    return folder


# ---------------------------------------------------------------------------- model and optimizer


# Peak dense (not sparse) bf16 FLOP/s per GPU, from the vendors' data sheets, for MFU. Matched in
# order on the words of torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"),
# a variant before the plain name it contains; whole words, so a GB200 is not taken for a B200.
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("GH200", 989e12), ("H200 NVL", 835e12),
              ("H200", 989e12), ("GB200", 2500e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12),
              ("A10", 125e12)]


def peak_flops(device_name):
    """The PEAK_FLOPS entry whose words appear, in order and whole, in the device's name; else None."""
    words = re.split(r"[\s\-_]+", device_name.upper())
    for key, flops in PEAK_FLOPS:
        key_words = key.upper().split()
        if any(words[i:i + len(key_words)] == key_words for i in range(len(words))):
            return flops
    return None


DDP = torch.nn.parallel.DistributedDataParallel
# The rotary tables are buffers every rank computes alike: DDP need not re-send them at each step.
# (torch 2.13 renamed the option; older versions, down to 2.4, know only broadcast_buffers.)
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})


def bf16_allreduce_hook(group, bucket):
    """DDP communication hook: average a bucket of float32 gradients as bf16, half the bytes on the
    wire. Not torch's bf16_compress_hook: DDP refuses that one without NCCL, so no CPU test could run it."""
    group = group or dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(
        lambda future: bucket.buffer().copy_(future.value()[0]))


def build(run):
    """The model and optimizer, restored from the checkpoint when resuming, then compiled and wrapped."""
    config, cuda = run.config, run.device.type == "cuda"
    torch.manual_seed(config.seed)
    run.raw_model = Model(run.model_config).to(run.device)
    # AdamW: weight decay on the backbone and head matrices only, a learning rate per kind of parameter
    run.optimizer = run.raw_model.configure_optimizers(config.lr, config.weight_decay, (config.beta1, config.beta2),
                                                       fused=cuda, lr_input=config.lr_input, lr_head=config.lr_head)
    run.writer = CheckpointWriter()
    if run.ckpt is not None:
        # No RNG state is restored: after the init above, no step draws a random number.
        run.raw_model.load_state_dict(run.ckpt["model"])
        run.optimizer.load_state_dict(run.ckpt["optimizer"])  # moves the moments onto the parameters' device
        run.step = run.ckpt["step"]
        run.ckpt = None  # nothing else is needed: let the full state dict go
    run.autocast = precision(run.device, config.bf16)
    run.compiled = config.compile if config.compile is not None else cuda
    if run.compiled:
        run.raw_model.compile()  # in place: raw_model keeps its state_dict keys and runs compiled
    run.model = run.raw_model
    if run.world > 1:
        # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, no second copy
        # (train_step keeps them so); the buckets are what the all-reduce sends.
        run.model = DDP(run.raw_model, device_ids=[run.device] if cuda else None, gradient_as_bucket_view=True,
                        **NO_BUFFER_SYNC)
        if config.bf16_allreduce:
            run.model.register_comm_hook(None, bf16_allreduce_hook)
    run.peak_flops = peak_flops(torch.cuda.get_device_name(run.device)) if cuda else None


def start_outputs(run):
    """Rank 0: print the config, write config.json, trim the log to the checkpoint, start wandb."""
    config, model_cfg = run.config, run.model_config
    counts = run.raw_model.param_counts()
    print(f"config: {json.dumps(asdict(config))}\nmodel: {json.dumps(asdict(model_cfg))}")
    print(f"parameters: {', '.join(f'{k} {v:,}' for k, v in counts.items())}; {run.world} x {run.device.type}, "
          f"{run.accum} micro-steps of {config.micro_batch} x {config.seq_len} per step")
    if not config.eval_only:
        write_json(os.path.join(config.out_dir, "config.json"), dict(train=asdict(config), model=asdict(model_cfg)))
        # a resumed run keeps its log up to the checkpoint; a new run starts a new log
        keep_log_until(os.path.join(config.out_dir, "log.jsonl"), run.step)
    if config.wandb_project:
        import wandb
        run.wandb = wandb.init(project=config.wandb_project, name=config.wandb_run_name or None, resume="allow",
                               config=dict(train=asdict(config), model=asdict(model_cfg), params=counts))


def set_up(argv):
    """The Run, built and with its outputs started; or None when set-up failed on any rank, after
    one error line for the whole job (from the lowest rank that failed)."""
    run, error = None, None
    try:
        run = open_run(argv)
    except UserError as e:
        error = e
    lowest = failed_rank(error)
    if lowest is not None:
        if int(os.environ.get("RANK", 0)) == lowest:
            print_error(error)
        return None
    build(run)
    if run.rank == 0:
        start_outputs(run)
    return run


# ---------------------------------------------------------------------------- main: set-up, the loop, shut-down


def main(argv):
    run = set_up(argv)
    if run is None:
        return shut_down(1)
    config, code = run.config, 0
    try:
        if config.eval_only:
            report_eval(run, evaluate(run))
        elif run.step >= run.max_steps:
            print(f"the run is complete ({run.step} steps); nothing to do")
        else:
            for signum in STOP_SIGNALS:
                signal.signal(signum, on_signal)
            timer_start, steps_timed = time.time(), 0
            while run.step < run.max_steps:
                loss, grad_norm, preempted = train_step(run)  # preempted: a signal reached some rank
                run.step, steps_timed = run.step + 1, steps_timed + 1
                last, stop = run.step == run.max_steps, preempted or run.step == config.stop_step
                if run.rank == 0 and (run.step % config.log_interval == 0 or last or stop):
                    log_step(run, loss, grad_norm, time.time() - timer_start, steps_timed)
                    timer_start, steps_timed = time.time(), 0
                if (run.step % config.eval_interval == 0 or last) and not preempted:  # a preemption saves first
                    report_eval(run, evaluate(run))
                    timer_start, steps_timed = time.time(), 0  # tokens/s counts training only
                if run.step % config.ckpt_interval == 0 or last or stop:
                    checkpoint(run, wait=last or stop)  # the last one must be on disk
                    timer_start, steps_timed = time.time(), 0
                if stop:
                    why = signal.Signals(STOP["signal"]).name if STOP["signal"] else f"--stop_step={config.stop_step}"
                    if run.rank == 0:
                        print(f"stopped at step {run.step} ({why}); checkpoint saved: continue with the same "
                              "command plus --resume")
                    code = 128 + STOP["signal"] if STOP["signal"] else 0
                    break
            else:
                if run.rank == 0:
                    print(f"done: {run.step} steps, {run.step * config.batch_tokens:,} tokens; "
                          f"checkpoint {config.out_dir}/ckpt.pt")
    except UserError as e:  # raised on every rank alike: the loss and the checkpoint's outcome are shared
        if run.rank == 0:
            print_error(e)
        code = 1
    finally:
        if run.rank == 0:
            run.writer.finish()  # a checkpoint still being written is completed
        if run.lock is not None:
            os.close(run.lock)  # the folder is free for the next run
    return shut_down(code)


# ---------------------------------------------------------------------------- one step


def lr_at(step, config, max_steps):
    """Linear warmup to lr, then cosine decay to min_lr_frac * lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, max_steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_frac + (1 - config.min_lr_frac) * cosine)


def to_batch(windows, device, lev):
    """(inputs, targets, distinct) on the device; for LEV, distinct is the inputs' distinct_ids,
    made here on the CPU so that the step need not wait for the device to know their number. On a
    GPU all three go in one pinned copy that the host does not wait for."""
    xy = torch.from_numpy(np.stack(windows).astype(np.int64))
    parts = [xy, *distinct_ids(xy[:, :-1])] if lev else [xy]
    if device.type == "cuda":
        flat = torch.cat([part.flatten() for part in parts]).pin_memory().to(device, non_blocking=True)
        parts = [piece.view(part.shape) for piece, part in zip(flat.split([part.numel() for part in parts]), parts)]
    return parts[0][:, :-1], parts[0][:, 1:], (tuple(parts[1:]) if lev else None)


def train_step(run):
    """One optimizer step over batch_tokens. Rank r's micro-step m takes the fixed slice
    (r * accum + m) of the step's windows, so the batch is the same for any world size."""
    micro_batch = run.config.micro_batch
    for group in run.optimizer.param_groups:  # each group's lr_scale: see Model.configure_optimizers
        group["lr"] = lr_at(run.step, run.config, run.max_steps) * group["lr_scale"]
    # Every rank reads the whole step's windows (each is checked as it is read), so that a damaged
    # one stops all ranks alike, with one error line, instead of one rank amid a collective.
    windows = [run.train[p] for p in range(run.position, run.position + run.step_windows)]
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = (run.rank * run.accum + micro) * micro_batch
        x, y, distinct = to_batch(windows[first:first + micro_batch], run.device, run.lev)
        last = micro == run.accum - 1  # all-reduce the gradients once, after the last micro-step
        with run.autocast, (run.model.no_sync() if run.world > 1 and not last else nullcontext()):
            loss = run.model(x, y, distinct=distinct)
        (loss / run.accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.config.grad_clip)
    # One all_reduce for the mean loss and "did any rank get a signal", so all ranks stop together.
    shared = torch.stack([loss_sum / run.accum, torch.tensor(float(STOP["signal"] is not None), device=run.device)])
    if run.world > 1:
        dist.all_reduce(shared)
    loss, stop, grad_norm = shared[0].item() / run.world, shared[1].item() > 0, grad_norm.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise UserError(f"non-finite loss ({loss}) or gradient norm at step {run.step + 1}: stopped without updating; "
                        "the last good checkpoint is kept (try a lower --lr)")
    run.optimizer.step()
    # Under DDP the gradients are views into its all-reduce buckets: zeroed in place they stay so, and
    # every micro-step accumulates into the buckets. Set to None, the no_sync micro-steps would make
    # fresh gradients beside the buckets (a second copy: 4.9 GB at 1.2b) for DDP to copy in at the end.
    run.optimizer.zero_grad(set_to_none=run.world == 1)
    return loss, grad_norm, stop


def log_step(run, loss, grad_norm, seconds, steps_done):
    step, config = run.step, run.config
    tokens_per_s = steps_done * config.batch_tokens / seconds
    eta = (run.max_steps - step) * seconds / steps_done
    record = dict(type="train", step=step, loss=loss, lr=lr_at(step - 1, config, run.max_steps),
                  grad_norm=grad_norm, tokens_seen=step * config.batch_tokens, tokens_per_s=tokens_per_s, eta_s=eta)
    line = f"step {step}/{run.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e} | {tokens_per_s:,.0f} tok/s"
    if run.peak_flops:
        record["mfu"] = run.raw_model.flops_per_token() * tokens_per_s / (run.peak_flops * run.world)
        line += f" | MFU {100 * record['mfu']:.1f}%"
    if run.compiled:  # graphs compiled so far and graph breaks met: both stop growing after the first steps
        record["graphs"] = counters["stats"]["unique_graphs"]
        record["graph_breaks"] = sum(counters["graph_break"].values())
    if run.device.type == "cuda":  # reserved: what the allocator holds, the figure that must fit the GPU
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
        record["peak_reserved_gb"] = torch.cuda.max_memory_reserved(run.device) / 1e9
        line += f" | peak mem {record['peak_mem_gb']:.1f} GB ({record['peak_reserved_gb']:.1f} reserved)"
    print(line + f" | ETA {int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}", flush=True)
    log_record(run, record)


def log_record(run, record):
    with open(os.path.join(run.config.out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if run.wandb:
        run.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])


# ---------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run):
    """Loss, perplexity, bits per byte and the frequency table over the fixed validation windows.
    Every rank evaluates every world_size-th window; one all_reduce adds up the sums."""
    # raw_model (compiled, not DDP): DDP's forward syncs buffers, which a rank with fewer windows would miss
    model = run.raw_model
    n_buckets, micro_batch = run.n_buckets, run.config.micro_batch
    nats, tokens, n_bytes = np.zeros(n_buckets), np.zeros(n_buckets), 0
    rank_windows = run.val[run.rank::run.world]
    for i in range(0, len(rank_windows), micro_batch):
        windows = rank_windows[i:i + micro_batch]
        # An uneven last batch is padded with copies of its last window, whose losses are dropped:
        # a batch of another shape would make the compiled model compile again.
        x, y, distinct = to_batch(windows + windows[-1:] * (micro_batch - len(windows)), run.device, run.lev)
        with run.autocast:
            losses = model(x, y, reduction="none", distinct=distinct)[:len(windows)]
        targets = y[:len(windows)].flatten().cpu().numpy()
        n, t = bucket_sums(losses.flatten().double().cpu().numpy(), run.counts[targets], n_buckets)
        nats, tokens, n_bytes = nats + n, tokens + t, n_bytes + int(run.byte_lengths[targets].sum())
    sums = torch.tensor(np.concatenate([nats, tokens, [n_bytes]]), dtype=torch.float64, device=run.device)
    if run.world > 1:
        dist.all_reduce(sums)
    nats, tokens, n_bytes = sums[:n_buckets].cpu().numpy(), sums[n_buckets:-1].cpu().numpy(), sums[-1].item()
    loss = nats.sum() / tokens.sum()
    return dict(val_loss=float(loss), val_ppl=math.exp(loss), val_bpb=float(nats.sum() / (math.log(2) * n_bytes)),
                eval_tokens=int(tokens.sum()), buckets=bucket_table(nats, tokens))


def report_eval(run, result):
    """Rank 0: print the result, write eval_step<N>.json and log it."""
    if run.rank != 0:
        return
    step = run.step
    print(f"eval step {step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
          f"{result['val_bpb']:.4f} bits/byte | {result['eval_tokens']:,} tokens")
    print(f"  {'train count':>13} {'tokens':>10} {'loss':>8} {'ppl':>12}")
    for row in result["buckets"]:
        if row["tokens"]:
            print(f"  {row['counts']:>13} {row['tokens']:>10,} {row['loss']:>8.4f} {row['ppl']:>12.2f}")
    record = dict(step=step, tokens_seen=step * run.config.batch_tokens, **result)
    write_json(os.path.join(run.config.out_dir, f"eval_step{step}.json"), record)
    log_record(run, dict(type="eval", **{k: v for k, v in record.items() if k != "buckets"}))


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


# ---------------------------------------------------------------------------- checkpoints
#
# ckpt.pt holds model, optimizer, model_config, train_config, data_meta, step and tokens_seen: all
# a resume needs, on any number of GPUs (the data position is step * step_windows; no step draws a
# random number, so no RNG state). Rank 0 writes it atomically in the background (sample.py reads it).


def checkpoint(run, wait=False):
    """Save the run at this step without stalling training: rank 0 copies the state to CPU memory
    (a second or so at 1.2b) and a background thread writes it, fsynced and renamed into place
    (atomic_write), while training goes on. One write at a time: the next checkpoint, or wait=True
    (the last step, a preemption), first waits for the one in flight. A failed write (a full disk)
    stops every rank alike, the moment rank 0 learns of it; the previous checkpoint is kept."""
    agree_on_write(run)  # the previous write
    if run.rank == 0:
        state = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                     model_config=asdict(run.model_config), train_config=asdict(run.config), data_meta=run.meta,
                     step=run.step, tokens_seen=run.step * run.config.batch_tokens)
        run.writer.start(os.path.join(run.config.out_dir, "ckpt.pt"), run.writer.copy_to_cpu(state), run.step)
    if wait:
        agree_on_write(run)


def agree_on_write(run):
    """Rank 0 waits for the write in flight; then every rank learns whether it failed."""
    error = None
    if run.rank == 0:
        try:
            run.writer.wait()
        except UserError as e:
            error = e
    if run.world > 1:
        saved = torch.tensor(float(error is None), device=run.device)
        dist.broadcast(saved, 0)
        if not saved.item() and error is None:
            error = UserError("rank 0 could not write the checkpoint")
    if error is not None:
        raise error


def map_tensors(obj, fn):
    """obj (dicts, lists and tuples of tensors and plain values) with fn applied to each tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def memory_of(t):
    """Where a tensor's values live: equal for two tensors that are views of the same values."""
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride()


class CheckpointWriter:
    """Rank 0's writer thread, and the CPU copy it writes from, allocated at the first checkpoint
    and reused: a 1.2b run holds one ~15 GB copy in host memory, exactly the state's size. Not
    pinned: the caching host allocator rounds each pinned tensor up to a power of two (~20 GB at
    1.2b, held for the whole run); a pageable copy is slower (the driver stages it), a few seconds
    at 1.2b once per checkpoint."""

    def __init__(self):
        self.thread, self.error, self.buffers = None, None, None

    def copy_to_cpu(self, state):
        """state with every tensor copied into the CPU buffers. Tensors that are one tensor (the tied
        arm's table, which state_dict lists again as the head) get one copy, which torch.save then
        writes once, as it would the originals."""
        tensors = {}  # the distinct tensors, by where their values live
        map_tensors(state, lambda t: tensors.setdefault(memory_of(t), t))
        shapes = [(t.shape, t.dtype) for t in tensors.values()]
        if self.buffers is None or [(b.shape, b.dtype) for b in self.buffers] != shapes:
            self.buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]
        copies = dict(zip(tensors, self.buffers))
        for key, t in tensors.items():
            copies[key].copy_(t)  # into pageable memory: complete before training changes the original
        return map_tensors(state, lambda t: copies[memory_of(t)])

    def start(self, path, state, step):
        self.thread = threading.Thread(target=self.write, args=(path, state, step))
        self.thread.start()

    def write(self, path, state, step):
        start = time.time()
        try:
            atomic_write(path, lambda f: torch.save(state, f))
        except (OSError, RuntimeError) as e:  # no space left: torch.save raises either
            reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
            self.error = UserError(f"could not write {path} ({reason}); the previous checkpoint is kept")
            return
        print(f"checkpoint: step {step}, {os.path.getsize(path) / 1e9:.2f} GB written in {time.time() - start:.1f} s "
              "(training went on meanwhile)", flush=True)

    def finish(self):
        """At exit, after an error elsewhere: let a write in flight complete, keeping that error."""
        if self.thread is not None:
            self.thread.join()

    def wait(self):
        """Until the write in flight is on disk; raises its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error


def check_checkpoint(ckpt, model_cfg, meta, path):
    here, there = asdict(model_cfg), ckpt["model_config"]
    if there != here:
        diff = [f"{k}={there.get(k)} there, {here.get(k)} here" for k in sorted(here.keys() | there.keys())
                if there.get(k) != here.get(k)]
        raise UserError(f"{path} holds a different model ({', '.join(diff)}): a dataset with another "
                        "tokenizer or other model options; use the checkpoint's or another --out_dir")
    same_tokenizer = ("tokenizer", "tokenizer_vocab_size", "vocab_size", "eot_id")
    if any(ckpt["data_meta"].get(k) != meta.get(k) for k in same_tokenizer):
        raise UserError(f"{path} was trained on data from another tokenizer ({ckpt['data_meta'].get('tokenizer')}, "
                        f"{ckpt['data_meta'].get('vocab_size')} ids) than this dataset ({meta.get('tokenizer')}, "
                        f"{meta.get('vocab_size')} ids)")


def read_log(path):
    """The records of a run's log.jsonl, in order ([] if it has none). A last line without its
    newline (a run killed while writing it) is left out; any other damaged line is one error."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                break
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not (isinstance(record, dict) and record.get("type") in ("train", "eval")
                    and isinstance(record.get("step"), int)):
                raise UserError(f"{path}, line {number}: not a log record (damaged or edited); delete that line "
                                "and run again")
            records.append(record)
    return records


def keep_log_until(path, step):
    """A resumed run keeps its log up to the checkpoint (an interrupted one may have logged past it);
    a new run (step 0) starts a new log."""
    records = [r for r in read_log(path) if r["step"] <= step] if step else []
    atomic_write(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in records), mode="w")


# ---------------------------------------------------------------------------- preemption signals and shut-down


# SIGTERM: torchrun, Kubernetes and SLURM's end of job; SIGUSR1: SLURM's `--signal` warning before the
# time limit. Both are a preemption: save and exit, with no evaluation in between.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
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
    # os.write, not print: a signal that lands during a print would make print re-enter itself
    os.write(sys.stdout.fileno(), f"\n{signal.Signals(signum).name}: saving a checkpoint at the end of this step\n".encode())


def shut_down(code):
    """Leave the process group once every rank is done; the exit status passes through."""
    if dist.is_initialized():
        dist.barrier()  # every rank has finished (and rank 0 has written its checkpoint)
        if dist.get_backend() == "gloo":
            # Tearing down gloo can deadlock on the GIL while its threads release Python-owned
            # tensors (pytorch#56297; observed in about 1 of 6 CPU runs, after all work was done), so
            # a gloo rank leaves without the teardown: everything it wrote is already flushed.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # run_main: Ctrl-C before the loop's handlers are in place (set-up, --eval_only) is one line
    sys.exit(run_main(main, sys.argv[1:]))
