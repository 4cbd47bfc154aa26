"""Train a Leviathan model (or a baseline) on prepare_data.py's token shards.

    python train.py --size=tiny                       # CPU, minutes (data/demo); then --resume or --eval_only
    torchrun --nproc_per_node=8 train.py --size=1.2b  # DDP; add --nnodes/--rdzv_* for several nodes

Each key of DEFAULTS is an option, --name=value (a bare --flag is true), and its comment says what it does;
a size (SIZES) sets its own values over tiny's.
"""
import argparse, datetime, importlib.util, json, math, os, re, signal, sys, time, uuid, zlib
from contextlib import nullcontext, suppress
from dataclasses import asdict, fields
from types import SimpleNamespace
import numpy as np
from prepare_data import quiet_interrupt
if __name__ == "__main__":  # before torch loads (seconds): Ctrl-C meanwhile is one line
    quiet_interrupt()
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.elastic.multiprocessing.errors import record

from leviathan import EMBEDDINGS, Config, Model, distinct_ids, padded_vocab, precision
from prepare_data import (ArgumentParser, UserError, atomic_write, load_meta, load_per_id, parse_bool,
                          parse_number, print_error, read_shard, run_main, shard_paths, write_json)

# ---------------------------------------------------------------------------- the options and the sizes
DEFAULTS = dict(  # tiny's: minutes on a 2-core CPU; each size in SIZES sets its own values over these
    # the run
    size="tiny",  # a row of SIZES: tiny | 200m | 400m | 1.2b
    embedding="lev",  # lev (Leviathan) | tied (the paper's baseline) | untied (the ablation)
    data_dir="data/demo",  # prepare_data.py's output
    out_dir="",  # "": out/<size>-<embedding>
    # the model: leviathan.Config (vocab_size comes from the data)
    d_model=128,  # width D
    n_layer=4,  # blocks
    n_head=4,  # attention heads
    seq_len=256,  # context, in tokens
    rope_theta=10_000.0,  # rotary base
    lev_digits=3,  # LEV: k digits per id
    lev_seed_dim=128,  # d_seed, the width of z
    lev_heads=4,  # h
    lev_knots=16,  # kappa
    lev_rank=32,  # r modes per head (tiny: h * r = D, not the paper's 512)
    lev_sigmoid_scale=0.5,  # t = sigmoid(scale * u), (R) 1/2
    # the batch
    total_tokens=2_703_360,  # steps = total_tokens // batch_tokens
    batch_tokens=16 * 256,  # of a step over all GPUs, whatever their number
    micro_batch=16,  # sequences per GPU per forward pass; accumulation makes up the rest
    # AdamW
    lr=3e-3,  # the backbone's peak rate
    lr_input=None,  # x lr for LEV or the input table (None: LR_SCALES)
    lr_head=None,  # x lr for the untied head (None: LR_SCALES)
    warmup_steps=30,  # linear warmup, then cosine decay to lr / 10 (lr_at)
    weight_decay=0.1,  # on the matrices only; betas (0.9, 0.95), GPT-3's
    grad_clip=1.0,  # on the gradients' global norm
    seed=1337,  # the model's init and the data order
    # evaluation, log, checkpoint: every *_interval steps and at the end
    eval_interval=200,
    eval_tokens=1 << 16,  # the first of the val split
    log_interval=10,
    ckpt_interval=200,
    eval_only=False,  # evaluate out_dir/ckpt.pt
    resume=False,  # continue from out_dir/ckpt.pt
    stop_step=0,  # save and exit there, the schedule unchanged (0: never)
    # the machine
    device="auto",  # auto (cuda if there is a GPU) | cpu | cuda
    compile=None,  # torch.compile (None: on CUDA only)
    bf16=None,  # bf16 autocast, LEV and the softmax in float32 (None: on CUDA only)
    bf16_allreduce=False,  # DDP's gradients in bf16, half the traffic (CUDA only)
    backend="auto",  # DDP's: auto (nccl on CUDA, gloo on CPU) | nccl | gloo (ranks sharing a GPU)
    deterministic=False,  # bit-identical reruns and resumes (CUDA: slower)
    wandb_project="",  # log to Weights & Biases there
)
# The paper's sizes: its batch and token budgets, GPT-3/Pythia rates (it publishes none), heads of 128 dims
# and the depth that brings the *tied* model closest to its size with o200k_base (README, "The backbone").
PAPER = dict(data_dir="data/pile", seq_len=512, lev_heads=8, lev_rank=64, batch_tokens=512 * 512,
             micro_batch=16, warmup_steps=1000, eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000)
SIZES = {  # each size: the options it sets over DEFAULTS
    "tiny": {},
    "200m": dict(PAPER, d_model=768, n_layer=7, n_head=6, total_tokens=4_200_000_000, lr=6e-4),
    "400m": dict(PAPER, d_model=1024, n_layer=15, n_head=8, total_tokens=8_400_000_000, lr=3e-4),
    "1.2b": dict(PAPER, d_model=2048, n_layer=16, n_head=16, total_tokens=24_100_000_000, lr=2e-4),
}
# (lr_input, lr_head) per size and arm, x lr (Model.configure_optimizers): the width sweep's best at D = 128,
# its power laws above (experiments/study.md). Zero heads and the tied table want far more, LEV a tenth.
LR_SCALES = {"tiny": {"lev": (0.1, 30.0), "tied": (30.0, 1.0), "untied": (1.0, 30.0)},
             "200m": {"lev": (0.1, 8.2), "tied": (13.0, 1.0), "untied": (1.0, 8.8)},
             "400m": {"lev": (0.1, 6.6), "tied": (12.0, 1.0), "untied": (1.0, 7.2)},
             "1.2b": {"lev": (0.1, 4.0), "tied": (10.0, 1.0), "untied": (1.0, 4.6)}}
# On --resume these may change freely; every other option changes the loss curve and must match.
RESUME_FREE = {"data_dir", "out_dir", "micro_batch", "eval_interval", "eval_tokens", "log_interval",
               "ckpt_interval", "eval_only", "resume", "stop_step", "device", "compile", "bf16",
               "bf16_allreduce", "backend", "deterministic", "wandb_project"}

def parse_args(argv):
    """--name=value options -> {name: value} for the options given (--resume must know which)."""
    parser = ArgumentParser("train.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = {"lr_input": float, "lr_head": float, "compile": bool, "bf16": bool}  # their default is None
    for name, default in DEFAULTS.items():
        kind = kinds.get(name, type(default))
        how = dict(type=parse_bool, nargs="?", const=True) if kind is bool else dict(  # --flag: --flag=true
            type=parse_number(kind) if kind in (int, float) else str)
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS, help=f"default {default!r}", **how)
    return vars(parser.parse_args(argv))

def check(c):
    """Refuse a value that would fail late or quietly train something else (the shape: model_config)."""
    v = vars(c)
    choices = dict(size=SIZES, embedding=EMBEDDINGS, device=("auto", "cpu", "cuda"),
                   backend=("auto", "nccl", "gloo"))
    positive = ("total_tokens", "batch_tokens", "micro_batch", "lr", "lr_input", "lr_head", "grad_clip",
                "eval_interval", "eval_tokens", "log_interval", "ckpt_interval")
    rules = [*((k, v[k] in kinds, f"one of {', '.join(kinds)}") for k, kinds in choices.items()),
             *((k, 0 < v[k] < math.inf, "> 0") for k in positive),
             *((k, 0 <= v[k] < math.inf, ">= 0") for k in ("warmup_steps", "weight_decay", "stop_step")),
             ("seed", 0 <= c.seed < 2**63, "in [0, 2**63)"),
             ("total_tokens", c.total_tokens >= c.batch_tokens, "at least one step (--batch_tokens)"),
             ("lr_head", c.embedding != "tied" or c.lr_head == 1.0,
              "1 in the tied arm, whose table is the head; use --lr_input"),
             ("wandb_project", not c.wandb_project or importlib.util.find_spec("wandb"),
              "empty without wandb: pip install wandb")]
    for name, good, rule in rules:
        if not good:
            raise UserError(f"--{name}={v[name]}: must be {rule}")
    return c

def resolve(given, saved=None):
    """The config: the options given over the checkpoint's (resuming), else over the size's and DEFAULTS."""
    if saved is not None:
        if changed := sorted(k for k, v in given.items() if k not in RESUME_FREE and saved.get(k) != v):
            raise UserError("the checkpoint comes from a different config: " + ", ".join(
                f"{k}={saved.get(k)} there, {given[k]} here" for k in changed) + "; use another --out_dir")
        if unknown := ", ".join(k for k, v in saved.items() if k not in DEFAULTS and v):  # else lost silently
            raise UserError(f"the checkpoint was trained with options this train.py lacks ({unknown}): "
                            "resume it with the train.py that wrote it, or start anew in another --out_dir")
        known = {k: v for k, v in saved.items() if k in DEFAULTS}
        return check(SimpleNamespace(**{**DEFAULTS, **known, **given}))
    size, arm = given.get("size", "tiny"), given.get("embedding", "lev")
    lr_input, lr_head = LR_SCALES.get(size, {}).get(arm, (1.0, 1.0))  # an unknown size or arm: check() says
    return check(SimpleNamespace(**{**DEFAULTS, **SIZES.get(size, {}), "lr_input": lr_input,
                                    "lr_head": lr_head, "out_dir": f"out/{size}-{arm}", **given}))

def model_config(config, n_ids):  # the model's Config, for a tokenizer of n_ids ids
    shape = {f.name: getattr(config, f.name) for f in fields(Config) if f.name != "vocab_size"}
    try:
        return Config(vocab_size=padded_vocab(n_ids), **shape)
    except ValueError as e:  # Config's own words, as an option: "lev_knots=1: ..." -> "--lev_knots=1: ..."
        raise UserError(f"--{e}") from None

# ---------------------------------------------------------------------------- stop signals and output
# SIGTERM: torchrun, Kubernetes and SLURM's end of job; SIGUSR1: SLURM's `--signal` warning before the time
# limit; SIGHUP: the terminal closed. Each is a preemption: save and exit, with no evaluation in between.
STOP = {"signal": None}  # the first stop signal this rank received

def on_signal(signum, frame):
    # Only note it: main() checkpoints at the end of the step. A second Ctrl-C leaves at once, past the
    # exit hooks (torch's, midway through a compile, can end in a traceback); the last checkpoint is kept.
    # A later SIGTERM (torchrun passes one on after a Ctrl-C) is ignored so that the save can finish.
    again = signum == signal.SIGINT == STOP["signal"]
    if STOP["signal"] is not None and not again:
        return
    STOP["signal"], name = signum, signal.Signals(signum).name
    note = "\ninterrupted\n" if again else f"\n{name}: saving a checkpoint at the end of this step\n"
    with suppress(OSError):  # no terminal any more (SIGHUP) or no reader: the save matters, not the note
        os.write(sys.stdout.fileno(), note.encode())  # not print, which a signal amid a print would re-enter
    if again:
        os._exit(128 + signum)

def show(text):
    """print. A reader gone (`train.py | head`) stops the run as a signal does, a closed terminal (EIO) does
    not (its SIGHUP does, unless ignored); output then goes nowhere, and stderr too if it is the same file."""
    try:
        print(text, flush=True)
    except OSError as e:
        nowhere = os.open(os.devnull, os.O_WRONLY)
        if os.path.sameopenfile(sys.stdout.fileno(), sys.stderr.fileno()):  # not isatty(): false once hung up
            os.dup2(nowhere, sys.stderr.fileno())
        os.dup2(nowhere, sys.stdout.fileno())
        if isinstance(e, BrokenPipeError):
            STOP["signal"] = STOP["signal"] or signal.SIGPIPE

# ---------------------------------------------------------------------------- set-up: device, DDP, data
def setup_device(config):
    """(device, rank, world size) from torchrun's variables (one process without them), the group joined.
    Refused, as silently wrong: RANK left over in a shell (a rank outside the world never saves)."""
    rank, world, local = (int(os.environ.get(name, default))
                          for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    if not 0 <= rank < world:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}: left over from another launch? "
                        "Unset it, or launch with torchrun (README)")
    # srun sets SLURM_STEP_NUM_TASKS in each task it starts; a batch script (one process) has SLURM_NTASKS
    if (tasks := int(os.environ.get("SLURM_STEP_NUM_TASKS", 1))) > 1 and "RANK" not in os.environ:
        raise UserError(f"one of {tasks} tasks srun started, without torchrun: each would train alone into "
                        "the same out_dir; launch with `srun torchrun ... train.py` (README)")
    kind = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError("--device=cuda but no CUDA GPU is available; use --device=cpu")
    if config.bf16_allreduce and kind != "cuda":  # torch's bf16 hook: DDP takes it in CUDA builds only
        raise UserError("--bf16_allreduce needs CUDA GPUs (torch's bf16 hook); leave it off here")
    if config.deterministic:  # cuBLAS repeats its sums only with a fixed workspace, set before its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    backend = config.backend if config.backend != "auto" else ("nccl" if kind == "cuda" else "gloo")
    # Ranks past the GPU count share GPUs: gloo allows it (the acceptance run puts 2 on one), NCCL refuses it
    node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if world > 1 and backend == "nccl" and node_ranks > torch.cuda.device_count():
        raise UserError(f"{node_ranks} ranks on this node but {torch.cuda.device_count()} GPU(s): NCCL needs "
                        "a GPU per rank; --backend=gloo lets ranks share a GPU")
    device = torch.device(kind, local % torch.cuda.device_count() if kind == "cuda" else None)
    if kind == "cuda":  # TF32 off: under autocast the only float32 matmuls left are LEV's, float32 on purpose
        torch.cuda.set_device(device)
    else:
        torch.set_flush_denormal(True)  # denormal floats (tiny Adam moments late in training) are slow on x86
    # 20 min for a collective's slowest rank: a first compile, or rank 0's 1.2b save (2.5 min at 100 MB/s)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=20),
                                device_id=device if backend == "nccl" else None)
    return device, rank, world

def open_data(data_dir):
    """meta.json, the shards of both splits (each read as used), each id's count in the training split, its
    UTF-8 bytes (bits per byte without the tokenizer) and the fingerprint a resume compares."""
    meta, splits = load_meta(data_dir), {}
    for split in ("train", "val"):
        splits[split] = [read_shard(path, meta["vocab_size"]) for path in shard_paths(data_dir, split)]
        found, listed = (len(splits[split]), sum(map(len, splits[split]))), meta["splits"][split]
        # a shard lost in a copy would train on less data, silently: the count must be what prepare_data wrote
        if found != (listed["shards"], listed["tokens"]):
            raise UserError(f"{data_dir} holds {found[0]} {split} shards of {found[1]:,} tokens, meta.json "
                            f"lists {listed['shards']} of {listed['tokens']:,}: prepare the data again")
    fingerprint = {split: {os.path.basename(s.filename): [len(s), zlib.crc32(s[:4096].tobytes())]
                           for s in shards} for split, shards in splits.items()}  # length, crc32 of its start
    n_ids = meta["vocab_size"]
    counts, byte_lengths = (load_per_id(data_dir, name, n_ids) for name in ("counts.npy", "token_bytes.npy"))
    return meta, splits, counts, byte_lengths, fingerprint

class Windows:
    """Training sequences: windows of seq_len + 1 tokens every seq_len tokens of each shard (a token is a
    target at most once per pass). Window p comes from a seeded shuffle per epoch, of the shards then of each
    shard's windows: little memory for billions of tokens, and the same window p for any world size, so the
    data position is the number of windows consumed."""

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
            self.shard, shard = k, self.shard_order[k]
            rng = np.random.default_rng([self.seed, epoch, shard])
            self.window_order = rng.permutation(self.sizes[shard])
        start = int(self.window_order[q - (self.ends[k] - self.sizes[self.shard_order[k]])]) * self.seq_len
        return self.checked(self.shards[self.shard_order[k]], start, self.seq_len, self.vocab_size)

    @staticmethod
    def checked(shard, start, seq_len, vocab_size):
        """shard[start:start + seq_len + 1], refused if it holds an id past the vocabulary (damaged tokens,
        intact header: a crash, or for LEV a padding row trained). Checked as read: a few MB a step."""
        window = shard[start:start + seq_len + 1]
        if window.max() >= vocab_size:
            at = int(np.argmax(window >= vocab_size))
            raise UserError(f"{shard.filename}: token {start + at:,} is id {int(window[at])}, past the "
                            f"vocabulary of {vocab_size:,} (a damaged shard): prepare the data again")
        return window

def keep_log_until(path, step):
    """A resume keeps log.jsonl's records up to its checkpoint (a killed run may have logged past it). A log
    is diagnostics, not state: a line that is no record (cut by a kill, edited) is dropped."""
    def kept(line):
        with suppress(ValueError, TypeError, KeyError):
            return json.loads(line)["step"] <= step
        return False
    lines = open(path, encoding="utf-8", errors="replace").readlines() if os.path.exists(path) else []
    kept_lines = [line.rstrip("\n") + "\n" for line in lines if kept(line)]
    atomic_write(path, lambda f: f.writelines(kept_lines), mode="w")

def run_files(out_dir):
    """The files a train.py run writes that are in out_dir (sorted)."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted(n for n in names
                  if n in ("ckpt.pt", "config.json", "log.jsonl") or re.fullmatch(r"eval_step\d+\.json", n))

def load_checkpoint(path, keys=("model", "model_config", "data_meta")):
    """A train.py checkpoint holding `keys`, memory-mapped on the CPU (only what is used is read)."""
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint {path} (not found): train first, or pass a train.py run's --out_dir")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        missing = [key for key in keys if key not in ckpt]
    except Exception as e:  # not torch.save's format, a damaged zip, pickled objects, not a dict
        raise UserError(f"{path} is not a readable train.py checkpoint (torch.load: {type(e).__name__}): "
                        "a save cut short, or another file; train again") from None
    if missing:
        raise UserError(f"{path} is not a train.py checkpoint (it lacks {', '.join(missing)})")
    return ckpt

def check_fit(ckpt, path, config, meta, fingerprint):
    """A checkpoint (whose options resolve() compared) must come from this tokenizer's data and, resuming,
    from this very data (--eval_only may use other data)."""
    trained, keys = ckpt["data_meta"], ("tokenizer", "tokenizer_vocab_size", "vocab_size", "eot_id")
    if any(trained.get(k) != meta.get(k) for k in keys):
        raise UserError(f"{path} was trained on data of another tokenizer ({trained.get('tokenizer')}, "
                        f"{trained.get('vocab_size')} ids) than {config.data_dir} ({meta['tokenizer']}, "
                        f"{meta['vocab_size']} ids)")
    if config.resume and ckpt["data"] != fingerprint:
        raise UserError(f"the data in {config.data_dir} changed since {path} was saved (its shards, their "
                        "lengths or first tokens): resume on the data it was trained on, or start anew in "
                        "another --out_dir")

def build(run, ckpt):
    """raw_model (the module saved and optimised, restored when resuming) and model, the form that runs it."""
    config, cuda = run.config, run.device.type == "cuda"
    torch.manual_seed(config.seed)
    run.raw_model = Model(run.model_config).to(run.device)
    run.optimizer = run.raw_model.configure_optimizers(config.lr, config.weight_decay, fused=cuda,
                                                       lr_input=config.lr_input, lr_head=config.lr_head)
    if ckpt is not None:  # no RNG state to restore: after the init above, no step draws a random number
        run.raw_model.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])  # moves the moments onto the parameters' device
        run.step = ckpt["step"]
    run.autocast = precision(run.device, config.bf16)
    run.compiled = config.compile if config.compile is not None else cuda
    if run.compiled:
        run.raw_model.compile()  # in place: raw_model keeps its state_dict keys and runs compiled
    run.model = run.raw_model
    if run.world > 1:  # gradient_as_bucket_view: the gradients are DDP's buckets, not a second copy
        run.model = torch.nn.parallel.DistributedDataParallel(
            run.raw_model, device_ids=[run.device] if cuda else None, gradient_as_bucket_view=True)
        if config.bf16_allreduce:
            run.model.register_comm_hook(None, bf16_compress_hook)

def set_up(argv):
    """The run: every check that can refuse it, in order, before anything is written; then its state."""
    given = parse_args(argv)
    config = resolve(given)  # also fixes the default out_dir
    path, loading = os.path.join(config.out_dir, "ckpt.pt"), config.resume or config.eval_only
    if not loading and (written := run_files(config.out_dir)):  # a new run would start over them
        raise UserError(f"{config.out_dir} holds another run's {', '.join(written)}: pass --resume "
                        "to continue it (from its ckpt.pt), or choose another --out_dir")
    device, rank, world = setup_device(config)
    keys = ("model", "optimizer", "model_config", "train_config", "data_meta", "step")
    ckpt = load_checkpoint(path, keys) if loading else None
    config = resolve(given, ckpt["train_config"]) if loading else config
    meta, splits, counts, byte_lengths, fingerprint = open_data(config.data_dir)
    model_cfg = model_config(config, meta["vocab_size"])
    if loading:
        check_fit(ckpt, path, config, meta, fingerprint)
    seq_len, n_val, n_ids = config.seq_len, max(1, config.eval_tokens // config.seq_len), meta["vocab_size"]
    if config.batch_tokens % (per_step := world * config.micro_batch * seq_len):
        raise UserError(f"batch_tokens={config.batch_tokens:,} does not divide over world size {world} x "
                        f"micro_batch {config.micro_batch} x seq_len {seq_len} = {per_step:,}")
    train = Windows(splits["train"], seq_len, config.seed, n_ids)
    # the validation windows: the first n_val of the val split, in order, the same tokens at every evaluation
    starts = [(s, i * seq_len) for s in splits["val"] for i in range((len(s) - 1) // seq_len)][:n_val]
    val = [Windows.checked(s, start, seq_len, n_ids) for s, start in starts]
    if train.total == 0 or not val:
        raise UserError(f"the data is shorter than one window of seq_len + 1 = {seq_len + 1} tokens")
    # counts: train-split count per id (frequency buckets); byte_lengths: UTF-8 bytes per id (bits per byte)
    run = SimpleNamespace(config=config, model_config=model_cfg, meta=meta, train=train, val=val,
                          counts=counts, byte_lengths=byte_lengths, fingerprint=fingerprint, device=device,
                          rank=rank, world=world, accum=config.batch_tokens // per_step, step=0, wandb=None,
                          max_steps=config.total_tokens // config.batch_tokens, lev=config.embedding == "lev",
                          wandb_id=(ckpt or {}).get("wandb_id") or uuid.uuid4().hex[:8])
    build(run, ckpt)
    outputs, params = dict(train=vars(config), model=asdict(model_cfg)), run.raw_model.param_counts()
    if rank == 0:  # the run folder is made only once everything else is right
        show(f"config: {json.dumps(outputs['train'])}\nmodel: {json.dumps(outputs['model'])}")
        show(f"parameters: {', '.join(f'{k} {v:,}' for k, v in params.items())}; {world} x {device.type}, "
             f"{run.accum} micro-steps of {config.micro_batch} x {seq_len} per step")
        if world > 1:  # the hook as DDP itself reports it (the acceptance run checks it for --bf16_allreduce)
            hook = run.model._get_ddp_logging_data().get("comm_hook") or "none (float32 all-reduce)"
            show(f"DDP: {world} ranks on {dist.get_backend()}, gradient comm hook {hook}")
        if not config.eval_only:
            os.makedirs(config.out_dir, exist_ok=True)
            write_json(os.path.join(config.out_dir, "config.json"), outputs)
            keep_log_until(os.path.join(config.out_dir, "log.jsonl"), run.step)
        if config.wandb_project:  # one W&B run over every --resume: its id is kept in the checkpoint
            import wandb
            run.wandb = wandb.init(project=config.wandb_project, config=dict(outputs, params=params),
                                   name=os.path.basename(os.path.abspath(config.out_dir)), id=run.wandb_id,
                                   resume="allow")
    return run

# ---------------------------------------------------------------------------- one step, and its log line
def lr_at(step, config, max_steps):
    """Linear warmup to lr, then cosine decay to lr / 10 at the last step (GPT-3's and Chinchilla's floor)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, max_steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (0.1 + 0.9 * cosine)

def to_batch(windows, device, lev):
    """(inputs, targets, distinct) on the device. LEV's distinct_ids are found here, on the CPU, so that the
    host need not wait for the GPU to know their number; copies to a GPU are pinned, so asynchronous."""
    xy = torch.from_numpy(np.stack(windows).astype(np.int64))
    parts = [xy, *distinct_ids(xy[:, :-1])] if lev else [xy]
    if device.type == "cuda":
        parts = [part.pin_memory().to(device, non_blocking=True) for part in parts]
    return parts[0][:, :-1], parts[0][:, 1:], (tuple(parts[1:]) if lev else None)

def accumulate_gradients(run, windows):
    """Forward and backward over this rank's micro-batches of the step's windows: rank r's micro-step m takes
    slice r * accum + m, so any world size trains on the same batch. Returns the summed micro-batch losses."""
    micro_batch, loss_sum = run.config.micro_batch, torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = (run.rank * run.accum + micro) * micro_batch
        x, y, distinct = to_batch(windows[first:first + micro_batch], run.device, run.lev)
        last = micro == run.accum - 1  # all-reduce the gradients once, after the last micro-step
        with run.autocast, (run.model.no_sync() if run.world > 1 and not last else nullcontext()):
            loss = run.model(x, y, distinct=distinct)
        (loss / run.accum).backward()  # the gradient of the mean over the step's micro-batches
        loss_sum += loss.detach()
    return loss_sum

def train_step(run):
    """One optimizer step; stop: the signal that reached some rank (the same on every rank), or None."""
    step_windows = run.config.batch_tokens // run.config.seq_len
    for group in run.optimizer.param_groups:  # each group's lr_scale: see Model.configure_optimizers
        group["lr"] = lr_at(run.step, run.config, run.max_steps) * group["lr_scale"]
    # Every rank reads (and checks) the whole step's windows, so that a damaged one stops all ranks
    # alike, with one error line, instead of one rank amid a collective.
    windows = [run.train[p] for p in range(run.step * step_windows, (run.step + 1) * step_windows)]
    loss_sum = accumulate_gradients(run, windows)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.config.grad_clip)
    # The mean loss, and any rank's stop signal (the highest if several): all ranks stop and exit alike
    loss, stop = loss_sum / run.accum, torch.tensor(STOP["signal"] or 0, device=run.device)
    if run.world > 1:
        dist.all_reduce(loss)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    loss, grad_norm, stop = loss.item() / run.world, grad_norm.item(), int(stop.item()) or None
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise UserError(f"non-finite loss ({loss}) or gradient norm at step {run.step + 1}: "
                        "stopped without updating; the last good checkpoint is kept (try a lower --lr)")
    run.optimizer.step()
    # Under DDP the gradients are views into its buckets: zeroed in place they stay so. Set to None,
    # the no_sync micro-steps would make a second copy beside the buckets (4.9 GB at 1.2b).
    run.optimizer.zero_grad(set_to_none=run.world == 1)
    return loss, grad_norm, stop

def log_record(run, record):
    with open(os.path.join(run.config.out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if run.wandb:
        run.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

def peak_flops(device_name):
    """Peak dense bf16 FLOP/s of one GPU (data sheets): the first entry made of whole words of the name (a
    variant before its plain name; a GB200 is no B200). None where unknown: no MFU rather than a wrong one."""
    peaks = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12, "H200 NVL": 835e12,
             "H200": 989e12, "GB200": 2500e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    return next((flops for name, flops in peaks.items() if set(name.upper().split()) <= words), None)

def log_step(run, loss, grad_norm, seconds, steps_done):
    step, config = run.step, run.config
    tokens_per_s = steps_done * config.batch_tokens / seconds
    eta = (run.max_steps - step) * seconds / steps_done
    lr = lr_at(step - 1, config, run.max_steps)
    record = dict(type="train", step=step, loss=loss, lr=lr, grad_norm=grad_norm,
                  tokens_seen=step * config.batch_tokens, tokens_per_s=tokens_per_s, eta_s=eta)
    line = f"step {step}/{run.max_steps} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"
    if run.compiled:  # graphs compiled so far and graph breaks met: both stop growing after the first steps
        record.update(graphs=counters["stats"]["unique_graphs"],
                      graph_breaks=sum(counters["graph_break"].values()))
    if run.device.type == "cuda":  # reserved: what the allocator holds, the figure that must fit the GPU
        record.update(peak_mem_gb=torch.cuda.max_memory_allocated(run.device) / 1e9,
                      peak_reserved_gb=torch.cuda.max_memory_reserved(run.device) / 1e9)
        line += f" | peak mem {record['peak_mem_gb']:.1f} GB ({record['peak_reserved_gb']:.1f} reserved)"
        if peak := peak_flops(torch.cuda.get_device_name(run.device)):
            record["mfu"] = run.raw_model.flops_per_token() * tokens_per_s / (peak * run.world)
            line += f" | MFU {record['mfu']:.1%}"
    show(f"{line} | ETA {datetime.timedelta(seconds=round(eta))}")
    log_record(run, record)

# ---------------------------------------------------------------------------- evaluation
def bucket_sums(losses, target_counts, n_buckets):
    """Nats and tokens per bucket of the targets' training counts: 0, then [10^(j-1), 10^j) for bucket j."""
    edges = 10 ** np.arange(n_buckets - 1, dtype=np.int64)  # 1, 10, 100, ...: exact integer bounds
    bucket = np.searchsorted(edges, np.asarray(target_counts), side="right")  # count 0 -> 0, 1-9 -> 1, ...
    nats = np.bincount(bucket, weights=np.asarray(losses, dtype=np.float64), minlength=n_buckets)
    return nats, np.bincount(bucket, minlength=n_buckets)

def bucket_table(nats, tokens):
    """The paper's frequency-stratified table: {counts, tokens, loss, ppl} per bucket (None if empty)."""
    losses = [float(n / t) if t else None for n, t in zip(nats, tokens)]
    return [dict(counts="0" if j == 0 else f"{10 ** (j - 1)}-{10 ** j - 1}", tokens=int(t), loss=loss,
                 ppl=None if loss is None else math.exp(loss))
            for j, (t, loss) in enumerate(zip(tokens, losses))]

@torch.no_grad()
def evaluate(run):
    """Loss, perplexity, bits per byte and the frequency table over the validation windows: each rank takes
    every world_size-th, one all_reduce adds the sums (raw_model: DDP's forward would add collectives)."""
    model, micro_batch = run.raw_model, run.config.micro_batch
    n_buckets = 1 + len(str(max(1, int(run.counts.max()))))  # 0, then the decades up to the largest count
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
    loss, bits_per_byte = nats.sum() / tokens.sum(), nats.sum() / (math.log(2) * n_bytes)
    result = dict(val_loss=float(loss), val_ppl=math.exp(loss), val_bpb=float(bits_per_byte),
                  eval_tokens=int(tokens.sum()), buckets=bucket_table(nats, tokens))
    if run.rank != 0:  # rank 0 prints it, writes eval_step<N>.json and logs it
        return result
    show(f"eval step {run.step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
         f"{result['val_bpb']:.4f} bits/byte | {result['eval_tokens']:,} tokens\n"
         f"  {'train count':>13} {'tokens':>10} {'loss':>8} {'ppl':>12}" + "".join(
             f"\n  {row['counts']:>13} {row['tokens']:>10,} {row['loss']:>8.4f} {row['ppl']:>12.2f}"
             for row in result["buckets"] if row["tokens"]))
    record = dict(step=run.step, tokens_seen=run.step * run.config.batch_tokens, **result)
    write_json(os.path.join(run.config.out_dir, f"eval_step{run.step}.json"), record)
    log_record(run, dict(type="eval", **{k: v for k, v in record.items() if k != "buckets"}))
    return result

# ---------------------------------------------------------------------------- checkpoints
# ckpt.pt holds all a resume needs, on any number of GPUs: the data position is step * batch_tokens // seq_len
# windows, and no step draws a random number. The write is synchronous, the simplest that is safe (README).
def checkpoint(run):
    """Rank 0 writes ckpt.pt. A failed write (a full disk) is an error that keeps the previous one whole (its
    rank exits, and torchrun stops the others)."""
    if run.rank != 0:
        return
    path, start = os.path.join(run.config.out_dir, "ckpt.pt"), time.time()
    state = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),  # tied table: once
                 model_config=asdict(run.model_config), train_config=vars(run.config), data_meta=run.meta,
                 data=run.fingerprint, step=run.step, tokens_seen=run.step * run.config.batch_tokens,
                 wandb_id=run.wandb_id)
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # no space left: torch.save raises either
        if isinstance(e, RuntimeError) and "PytorchStreamWriter" not in str(e):
            raise  # not the write: a CUDA error (copying the weights off the GPU) is reported as itself
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise UserError(f"could not write {path} ({reason}); the previous checkpoint is kept") from None
    show(f"checkpoint: step {run.step}, {os.path.getsize(path) / 1e9:.2f} GB in {time.time() - start:.1f} s")

def shut_down(run, code, together=True):
    """Returns code, once rank 0 has finished its W&B run. Ranks ending together (done, a stop, an evaluation)
    meet at a barrier and NCCL's group is destroyed. os._exit (output flushed) only where needed: gloo's
    teardown can hang (pytorch#56297), and a rank leaving alone (an error) cannot tear the group down."""
    if run is not None and run.wandb:
        run.wandb.finish(exit_code=code)
    if dist.is_initialized():
        if together:
            dist.barrier()
        if together and dist.get_backend() == "nccl":
            dist.destroy_process_group()
            return code
        sys.stdout.flush()  # os._exit skips it (stderr flushes each line)
        os._exit(code)
    return code

# ------------------------------------------------------------------------- main: set-up, the loop, shut-down
def main(argv):
    run = None
    try:
        run = set_up(argv)
        config = run.config
        if config.eval_only:
            evaluate(run)
            return shut_down(run, 0)
        for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGHUP"):  # (Windows has no SIGUSR1 or SIGHUP)
            signum = getattr(signal, name, None)
            if signum and signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(signum, on_signal)
        seconds, steps_timed = 0.0, 0  # for tokens/s: the time in train_step only
        while run.step < run.max_steps:
            start = time.time()
            loss, grad_norm, preempted = train_step(run)  # preempted: the signal that reached some rank
            run.step, seconds, steps_timed = run.step + 1, seconds + time.time() - start, steps_timed + 1
            last, stop = run.step == run.max_steps, preempted or run.step == config.stop_step
            if run.rank == 0 and (run.step % config.log_interval == 0 or last or stop):
                log_step(run, loss, grad_norm, seconds, steps_timed)
                seconds, steps_timed = 0.0, 0
            # The save before an evaluation: a kill during it (or its first compile) then loses no step
            if run.step % config.ckpt_interval == 0 or last or stop:
                checkpoint(run)
            if (run.step % config.eval_interval == 0 or last) and not preempted:  # preempted: just save
                evaluate(run)
            if stop:
                why = signal.Signals(preempted).name if preempted else f"--stop_step={config.stop_step}"
                if run.rank == 0:
                    show(f"stopped at step {run.step} ({why}); checkpoint saved: continue with the same "
                         "command plus --resume")
                return shut_down(run, 128 + preempted if preempted else 0)  # all ranks alike: one status
        if run.rank == 0:
            show(f"done: {run.step} steps; checkpoint {config.out_dir}/ckpt.pt")
        return shut_down(run, 0)
    except UserError as e:  # in set-up, this rank's own (torchrun stops the others, naming it); later, every
        if run is None or run.rank == 0:  # rank's alike (the loss, the data) or rank 0's (its save)
            print_error(e)
        return shut_down(run, 1, together=False)

if __name__ == "__main__":
    # run_main: Ctrl-C before the loop's handlers are in place (set-up, --eval_only) is one line
    sys.exit(run_main(record(main), sys.argv[1:]))  # record: torchrun names the rank a traceback ended
