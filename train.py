"""Train a Leviathan model (or a baseline) on prepare_data.py's token shards.

    python train.py                                   # tiny, on a CPU (data/demo); then --resume
    torchrun --nproc_per_node=8 train.py --size=1.2b  # DDP on 8 GPUs; --help: every option

Read top to bottom: the options, the set-up (processes, data, model, resume), the step,
evaluation, the checkpoint, the loop.
"""
import argparse, datetime, importlib.util, json, math, os, shutil, signal, sys, time, uuid, zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.elastic.multiprocessing.errors import record

from leviathan import EMBEDDINGS, Config, Model, distinct_ids, precision
from prepare_data import (UserError, atomic_write, check_checkpoint, hold_folder, open_prepared,
                          write_json)

# ---------------------------------------------------------------------------- the options
OPTIONS = dict(  # name=(tiny's default, what it does); each of SIZES sets its own values over these
    size=("tiny", "a row of SIZES: the model's shape and its training budget"),
    embedding=("lev", "lev (Leviathan) | tied (the paper's baseline) | untied (the ablation)"),
    data_dir=("data/demo", "prepare_data.py's output"),
    out_dir=("", "the run folder (default: out/<size>-<embedding>)"),
    d_model=(128, "width D"),  # the model: leviathan.Config (vocab_size comes from the data)
    n_layer=(4, "blocks"),
    n_head=(4, "attention heads"),
    seq_len=(256, "context, in tokens"),
    rope_theta=(10_000.0, "rotary base"),
    lev_digits=(3, "LEV: k digits per id"),
    lev_seed_dim=(128, "LEV: d_seed, the width of z"),
    lev_heads=(4, "LEV: h heads"),
    lev_knots=(16, "LEV: kappa knots per spline"),
    lev_rank=(32, "LEV: r modes per head (tiny: h * r = D, not the paper's 512)"),
    lev_sigmoid_scale=(0.5, "LEV: t = sigmoid(scale * u), (R) 1/2"),
    total_tokens=(2_703_360, "the run's length: steps = total_tokens // batch_tokens"),
    batch_tokens=(16 * 256, "tokens per step over all GPUs, whatever their number"),
    micro_batch=(16, "sequences per GPU per forward pass; accumulation makes up the rest"),
    lr=(3e-3, "the backbone's peak learning rate (AdamW, betas 0.9, 0.95)"),
    lr_input=(None, "x lr for LEV or the input table (LR_SCALES: by size and arm)"),
    lr_head=(None, "x lr for the untied head (LR_SCALES: by size and arm)"),
    warmup_steps=(30, "linear warmup, then cosine decay to lr / 10"),
    weight_decay=(0.1, "on the matrices only"),
    grad_clip=(1.0, "the gradients' largest global norm"),
    seed=(1337, "the model's init and the data order"),
    eval_interval=(200, "evaluate every this many steps, and at the end"),
    eval_tokens=(1 << 16, "tokens evaluated: the first of the val split"),
    log_interval=(10, "log every this many steps, and at the end"),
    ckpt_interval=(200, "save ckpt.pt every this many steps, and at the end"),
    eval_only=(False, "evaluate out_dir/ckpt.pt, train nothing"),
    resume=(False, "continue from out_dir/ckpt.pt"),
    stop_step=(0, "save and exit at this step, the schedule unchanged (0: never; not resumed)"),
    device=("auto", "auto (cuda if there is a GPU) | cpu | cuda"),
    compile=(None, "torch.compile (default: on CUDA only)"),
    bf16=(None, "bf16 autocast, LEV and the softmax in float32 (default: on CUDA only)"),
    bf16_allreduce=(False, "DDP's gradients in bf16, half the traffic (CUDA only)"),
    backend=("auto", "DDP's: auto (nccl on CUDA, gloo on CPU) | nccl | gloo"),
    deterministic=(False, "bit-identical reruns and resumes (CUDA: slower)"),
    wandb_project=("", "log to Weights & Biases there"),
)
DEFAULTS = {name: default for name, (default, sentence) in OPTIONS.items()}
CHOICES = dict(embedding=EMBEDDINGS, device=("auto", "cpu", "cuda"),
               backend=("auto", "nccl", "gloo"))
# The paper's sizes and budgets; GPT-3/Pythia rates (it publishes none); heads of 128 dims (README)
PAPER = dict(data_dir="data/pile", seq_len=512, lev_heads=8, lev_rank=64, batch_tokens=512 * 512,
             warmup_steps=1000, eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000)
SIZES = {  # each size: the options it sets over DEFAULTS
    "tiny": {},
    "200m": dict(PAPER, d_model=768, n_layer=7, n_head=6, total_tokens=4_200_000_000, lr=6e-4),
    "400m": dict(PAPER, d_model=1024, n_layer=15, n_head=8, total_tokens=8_400_000_000, lr=3e-4),
    "1.2b": dict(PAPER, d_model=2048, n_layer=16, n_head=16, total_tokens=24_100_000_000, lr=2e-4),
}
# (lr_input, lr_head) x lr per size and arm: the width sweep's best at D = 128, its power laws above
LR_SCALES = {"tiny": {"lev": (0.1, 30.0), "tied": (30.0, 1.0), "untied": (1.0, 30.0)},
             "200m": {"lev": (0.1, 8.2), "tied": (13.0, 1.0), "untied": (1.0, 8.8)},
             "400m": {"lev": (0.1, 6.6), "tied": (12.0, 1.0), "untied": (1.0, 7.2)},
             "1.2b": {"lev": (0.1, 4.0), "tied": (10.0, 1.0), "untied": (1.0, 4.6)}}
# These may differ on --resume, and from rank to rank; every other option changes the loss curve.
RESUME_FREE = {"data_dir", "out_dir", "micro_batch", "eval_interval", "eval_tokens", "log_interval",
               "ckpt_interval", "eval_only", "resume", "stop_step", "device", "compile", "bf16",
               "bf16_allreduce", "backend", "deterministic", "wandb_project"}

def read_options(argv, saved=None):
    """The run's options: those given on the command line, over the checkpoint's (saved, resuming)
    or the size's, its arm's LR_SCALES and DEFAULTS. Refused: what would otherwise go unseen."""
    usage = "%(prog)s [--name=value ...]"
    preset = argparse.ArgumentParser("train.py", usage, add_help=False)  # they set the defaults
    preset.add_argument("--size", choices=SIZES, default="tiny")
    preset.add_argument("--embedding", choices=EMBEDDINGS, default="lev")
    known = preset.parse_known_args(argv)[0]
    lr_input, lr_head = LR_SCALES[known.size][known.embedding]
    defaults = {**DEFAULTS, **SIZES[known.size], "embedding": known.embedding, "lr_input": lr_input,
                "lr_head": lr_head, "out_dir": f"out/{known.size}-{known.embedding}"}
    parser = argparse.ArgumentParser("train.py", usage, description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (default, sentence) in OPTIONS.items():
        # SUPPRESS: only the options given are set; a resume takes the others from its checkpoint
        shown = dict(default=argparse.SUPPRESS, help=f"{sentence} (default {defaults[name]!r})")
        if type(default) is bool or name in ("compile", "bf16"):
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, **shown)
        else:
            kind = float if default is None else type(default)
            parser.add_argument(f"--{name}", type=kind, choices=CHOICES.get(name), **shown)
    given = vars(parser.parse_args(argv))
    if saved is not None:  # resuming: the checkpoint's options, under those given
        check_resumed(given, saved)
        defaults = {**DEFAULTS, **saved, "stop_step": 0}  # a plain --resume goes on to the end
    config = SimpleNamespace(**{**defaults, **given})
    if config.embedding == "tied" and config.lr_head != 1.0:  # would be ignored
        raise UserError("--lr_head must be 1 in the tied arm, whose table is the head: --lr_input")
    if min(config.eval_interval, config.log_interval, config.ckpt_interval) < 1:  # the loop's %
        raise UserError("--eval_interval, --log_interval and --ckpt_interval must be at least 1")
    if config.wandb_project and not importlib.util.find_spec("wandb"):
        raise UserError("--wandb_project needs wandb: pip install wandb")
    return config

def check_resumed(given, saved):
    """The options given to a resume (or --eval_only) against its checkpoint's."""
    changed = [k for k, v in given.items() if k not in RESUME_FREE and saved.get(k) != v]
    if changed:  # the run would go on along another loss curve
        raise UserError(f"the checkpoint was trained with other {', '.join(changed)}: leave "
                        "them out to resume, or train anew in another --out_dir")
    unknown = [k for k, v in saved.items() if k not in OPTIONS and v]
    if unknown:  # a newer train.py's option, which this one would drop
        raise UserError(f"the checkpoint was trained with {', '.join(unknown)}, which this "
                        "train.py lacks: resume it with the command that trained it")

# ---------------------------------------------------------------------------- the set-up: processes
def setup_device(config):
    """(device, rank, world size) from torchrun's variables (one process without them); on several
    processes, the process group joined."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:  # RANK left in a shell: no rank 0 would save, nor wait for this one
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}: unset both, or use torchrun")
    if config.deterministic:  # cuBLAS repeats its sums only with a fixed workspace, set before use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)  # recent torch: inductor's deterministic mode too
    if config.device == "cpu" or config.device == "auto" and not torch.cuda.is_available():
        torch.set_flush_denormal(True)  # denormal floats (tiny Adam moments) are slow on x86
        device = torch.device("cpu")
    else:  # TF32 stays off: under autocast the only float32 matmuls left are LEV's, on purpose
        torch.cuda.init()  # no GPU, or a torch without CUDA: torch says so here
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if world > 1:
        join_process_group(config.backend, device, rank, world)
    return device, rank, world

def join_process_group(backend, device, rank, world):
    """The ranks' process group: NCCL's on GPUs; gloo's on CPUs, or for ranks sharing a GPU."""
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if rank == 0:  # torchrun's variables left in a shell would otherwise wait here in silence
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        say(f"waiting for {world} ranks at {where}")
    # 20 min for a collective's slowest rank: a first compile, or rank 0's 1.2b save
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=20),
                            device_id=device if backend == "nccl" else None)

def agree(config, fingerprint, world):
    """One collective before DDP's first: every rank's loss-changing options, data and code are rank
    0's (a node started with another --lr, other data or another checkout would otherwise train on
    without a sign)."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.join(here, name) for name in ("train.py", "leviathan.py", "prepare_data.py")]
    code = [zlib.crc32(open(path, "rb").read()) for path in files]
    ranks = [None] * world
    dist.all_gather_object(ranks, dict(vars(config), data=fingerprint, code=code))
    for r, theirs in enumerate(ranks):
        differ = [k for k in theirs if k not in RESUME_FREE and theirs[k] != ranks[0][k]]
        if differ:
            raise UserError(f"rank {r} differs from rank 0 in {', '.join(differ)}: "
                            "start every rank alike")

# ---------------------------------------------------------------------------- the set-up: data
def open_data(config, splits):
    """(train, val) of the prepared splits, as Run declares them."""
    train = Windows(splits["train"], config.seq_len, config.seed)
    n_val = max(1, config.eval_tokens // config.seq_len)  # the val split's first windows
    length = config.seq_len
    starts = [(s, i * length) for s in splits["val"] for i in range((s.n - 1) // length)]
    val = [s[start:start + config.seq_len + 1] for s, start in starts[:n_val]]
    if not val or train.total == 0:  # evaluations of nothing; a division by zero at the first step
        raise UserError(f"a split is shorter than one window, seq_len + 1 = {config.seq_len + 1} tokens")
    return train, val

class Windows:
    """Training window p (seq_len + 1 tokens: inputs, then targets) by its place in the data order,
    the same at any world size. Each epoch shuffles the shards, then each shard's windows (one every
    seq_len tokens), seeded: little memory, and a shard's windows read together."""
    def __init__(self, shards, seq_len, seed):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        self.sizes = np.array([(s.n - 1) // seq_len for s in shards])  # windows per shard
        self.total = int(self.sizes.sum())
        self.epoch = self.shard = None  # the shuffles in use; consecutive windows share them
    def __getitem__(self, p):
        epoch, q = divmod(p, self.total)  # window q of an epoch
        if self.epoch != epoch:  # the epoch's shard order, and where each shard's windows end in it
            self.epoch = epoch
            self.shard = None
            rng = np.random.default_rng([self.seed, epoch])
            self.shard_order = rng.permutation(len(self.shards))
            self.ends = np.cumsum(self.sizes[self.shard_order])
        k = int(np.searchsorted(self.ends, q, side="right"))  # the epoch's k-th shard holds q
        shard = self.shard_order[k]
        if self.shard != shard:  # the shard's window order in this epoch
            self.shard = shard
            rng = np.random.default_rng([self.seed, epoch, shard])
            self.window_order = rng.permutation(self.sizes[shard])
        first = self.ends[k] - self.sizes[shard]  # the epoch's first window from this shard
        start = int(self.window_order[q - first]) * self.seq_len
        return self.shards[shard][start:start + self.seq_len + 1]

# ---------------------------------------------------------------------------- the set-up: model
def build(config, model_config, device, world, ckpt):
    """(raw_model, model, optimizer), restored when resuming; compiled in place (the state_dict keys
    stay); model is what the step runs: raw_model, or DDP's wrapper around it."""
    torch.manual_seed(config.seed)
    raw_model = Model(model_config).to(device)
    cuda = device.type == "cuda"
    optimizer = raw_model.configure_optimizers(config.lr, config.weight_decay, fused=cuda,
                                               lr_input=config.lr_input, lr_head=config.lr_head)
    if ckpt is not None:  # no RNG state to restore: after the init above, no step draws a number
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])  # onto the parameters' device
    if config.compile or config.compile is None and cuda:
        raw_model.compile()
    if world == 1:
        return raw_model, raw_model, optimizer
    return raw_model, wrap_ddp(raw_model, device, config.bf16_allreduce), optimizer

def wrap_ddp(raw_model, device, bf16_allreduce):
    """DDP's wrapper: its backward all-reduces the gradients, bucket by bucket, as they are made."""
    device_ids = [device] if device.type == "cuda" else None
    # gradient_as_bucket_view: the gradients live in DDP's buckets, not in a second copy
    model = torch.nn.parallel.DistributedDataParallel(raw_model, device_ids,
                                                      gradient_as_bucket_view=True)
    if bf16_allreduce:
        model.register_comm_hook(None, bf16_compress_hook)
    return model

# ------------------------------------------------------------------------ the run, resumed or new
@dataclass(kw_only=True)
class Run:
    """What one process holds, in set_up's order."""
    config: SimpleNamespace  # the options (read_options)
    meta: dict  # the data folder's meta.json
    fingerprint: dict  # each shard's length and the crc32 of its start (prepare_data.open_prepared)
    train: Windows  # the training windows, by their place in the data order
    val: list  # the validation windows: the same at every evaluation
    counts: np.ndarray  # each id's count in the training split: the frequency table's buckets
    byte_lengths: np.ndarray  # each id's UTF-8 bytes: bits per byte
    device: torch.device
    rank: int  # this process, of `world` (torchrun's RANK and WORLD_SIZE)
    world: int
    raw_model: Model  # the module saved and optimised
    model: torch.nn.Module  # what the step runs: raw_model, or DDP's wrapper around it
    optimizer: torch.optim.Optimizer
    step: int  # optimizer steps done
    max_steps: int
    accum: int  # micro-steps per step on this rank
    wandb_id: str  # kept in the checkpoint: a --resume continues the same W&B run
    wandb: object = None  # rank 0's W&B run, with --wandb_project
    lock: object = None  # rank 0's hold on out_dir (prepare_data.hold_folder)

RUN_FILES = ("ckpt.pt", "config.json", "log.jsonl")  # a run's, in out_dir

def set_up(argv):
    """The run; every refusal comes before anything is written or trained."""
    config = read_options(argv)
    ckpt = None
    if config.resume or config.eval_only:  # its options in force before the device is set up
        path = os.path.join(config.out_dir, "ckpt.pt")
        check_checkpoint(path)
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        config = read_options(argv, saved=ckpt["train_config"])
    elif any(os.path.exists(os.path.join(config.out_dir, name)) for name in RUN_FILES):
        raise UserError(f"{config.out_dir} holds another run: pass --resume to continue it, "
                        "or another --out_dir")
    device, rank, world = setup_device(config)
    meta, splits, counts, byte_lengths, fingerprint = open_prepared(config.data_dir)
    model_config = Config.from_options(config, meta["vocab_size"])  # Config checks the shape
    train, val = open_data(config, splits)
    if ckpt is not None:
        check_data(config, ckpt, meta, fingerprint)
    per_micro_step = world * config.micro_batch * config.seq_len
    if min(config.batch_tokens, per_micro_step) < 1 or config.batch_tokens % per_micro_step:
        # each step would train on fewer tokens than asked; or none
        raise UserError(f"--batch_tokens={config.batch_tokens} is not a multiple of world size "
                        f"{world} x micro_batch {config.micro_batch} x seq_len {config.seq_len}")
    if world > 1:
        agree(config, fingerprint, world)
    raw_model, model, optimizer = build(config, model_config, device, world, ckpt)
    run = Run(config=config, meta=meta, fingerprint=fingerprint, train=train, val=val,
              counts=counts, byte_lengths=byte_lengths, device=device, rank=rank, world=world,
              raw_model=raw_model, model=model, optimizer=optimizer,
              step=ckpt["step"] if ckpt else 0,
              max_steps=config.total_tokens // config.batch_tokens,
              accum=config.batch_tokens // per_micro_step,
              wandb_id=ckpt.get("wandb_id") if ckpt else uuid.uuid4().hex[:8])
    if rank == 0:
        open_outputs(run)
    return run

def check_data(config, ckpt, meta, fingerprint):
    """A checkpoint against the data it is to resume on, or be evaluated on."""
    tokenizer = ("tokenizer", "tokenizer_vocab_size", "vocab_size")
    if any(ckpt["data_meta"].get(k) != meta.get(k) for k in tokenizer):  # its ids: other text
        raise UserError(f"the checkpoint was trained on another tokenizer than {config.data_dir}'s")
    if config.resume and ckpt["data"] != fingerprint:  # it would go on over other windows
        raise UserError(f"the data in {config.data_dir} changed since the checkpoint: resume on "
                        "its own data, or train anew in another --out_dir")
    # --eval_only on other data or tokens than the run's: results apart, in a folder named by what
    # made them (a folder name alone may since point elsewhere), never over another's
    asked = dict(data=fingerprint, eval_tokens=config.eval_tokens)
    runs_own = dict(data=ckpt["data"], eval_tokens=ckpt["train_config"]["eval_tokens"])
    if config.eval_only and asked != runs_own:
        key = zlib.crc32(json.dumps(asked, sort_keys=True).encode())
        name = os.path.basename(os.path.abspath(config.data_dir))
        config.out_dir = os.path.join(config.out_dir, f"eval-{name}-{key:08x}")

def open_outputs(run):
    """Rank 0's: out_dir made and held, the run described (config.json: options, model, data read),
    the log cut back, W&B."""
    config = run.config
    outputs = dict(train=vars(config), model=asdict(run.raw_model.cfg), data=run.fingerprint)
    os.makedirs(config.out_dir, exist_ok=True)
    run.lock = hold_folder(config.out_dir)  # a requeued job beside its twin: both would save
    params = run.raw_model.param_counts()
    # room for one more ckpt.pt (float32 weights, AdamW's moments): else the first save finds out
    need = 12 * params["total"]
    if shutil.disk_usage(config.out_dir).free < need:
        raise UserError(f"{config.out_dir} has less than the {need / 1e9:.1f} GB a checkpoint "
                        "needs: free space there, or give another --out_dir")
    say(f"config: {json.dumps(outputs['train'])}\nmodel: {json.dumps(outputs['model'])}")
    say(f"parameters: {', '.join(f'{k} {v:,}' for k, v in params.items())}; {run.world} x "
        f"{run.device.type}, {run.accum} micro-steps of {config.micro_batch} x {config.seq_len}")
    if not config.eval_only:
        path = os.path.join(config.out_dir, "config.json")
        atomic_write(path, lambda f: json.dump(outputs, f, indent=2), mode="w")
    if config.resume:
        keep_log_until(os.path.join(config.out_dir, "log.jsonl"), run.step)
    if config.wandb_project:  # one W&B run over every --resume: its id is in the checkpoint
        import wandb
        run.wandb = wandb.init(project=config.wandb_project, name=config.out_dir, id=run.wandb_id,
                               resume="allow", config=dict(outputs, params=params))

def keep_log_until(path, step):
    """log.jsonl's records up to the resumed step: a kill may have left later ones, a cut line."""
    kept = []
    if os.path.exists(path):
        for line in open(path, encoding="utf-8", errors="replace"):
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line.rstrip("\n") + "\n")
            except (ValueError, KeyError, TypeError):
                pass  # a line cut short by the kill
    atomic_write(path, lambda f: f.writelines(kept), mode="w")

# ---------------------------------------------------------------------------- one step
STOP = {"signal": 0}  # the first stop signal this rank received (on_signal); the loop saves, exits

def to_batch(windows, device, lev):
    """(inputs, targets, distinct) on the device; LEV's distinct_ids found on the CPU, where the
    batch starts: the GPU is not waited for."""
    xy = torch.from_numpy(np.stack(windows).astype(np.int64))
    distinct = distinct_ids(xy[:, :-1]) if lev else ()
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
        distinct = [part.pin_memory().to(device, non_blocking=True) for part in distinct]
    return xy[:, :-1], xy[:, 1:], tuple(distinct) or None

def accumulate_gradients(run):
    """The summed loss of this rank's micro-batches, their gradients accumulated. Rank r's
    micro-step m reads the step's slice r * accum + m of micro_batch windows: at any world size,
    the same batch."""
    micro_batch = run.config.micro_batch
    step_start = run.step * (run.config.batch_tokens // run.config.seq_len)  # earlier windows
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = step_start + (run.rank * run.accum + micro) * micro_batch
        windows = [run.train[p] for p in range(first, first + micro_batch)]
        x, y, distinct = to_batch(windows, run.device, run.config.embedding == "lev")
        sync = run.world == 1 or micro == run.accum - 1  # DDP all-reduces once, after the last
        no_sync = nullcontext() if sync else run.model.no_sync()
        with precision(run.device, run.config.bf16), no_sync:
            loss = run.model(x, y, distinct=distinct)
        (loss / run.accum).backward()  # the gradient of the mean over the step's micro-batches
        loss_sum += loss.detach()
    return loss_sum

def train_step(run):
    """One optimizer step: (loss, grad_norm, lr, stop); stop is the stop signal that reached any
    rank (0: none), so that every rank stops at the same step."""
    config = run.config
    # linear warmup to lr, then cosine decay to lr / 10 at the last step (GPT-3's, Chinchilla's)
    if run.step < config.warmup_steps:
        lr = config.lr * (run.step + 1) / config.warmup_steps
    else:
        progress = (run.step - config.warmup_steps) / max(1, run.max_steps - config.warmup_steps)
        lr = config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    for group in run.optimizer.param_groups:  # each group's lr_scale: Model.configure_optimizers
        group["lr"] = lr * group["lr_scale"]
    loss_sum = accumulate_gradients(run)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), config.grad_clip)
    loss = loss_sum / run.accum
    stop = torch.tensor(STOP["signal"], device=run.device)
    if run.world > 1:  # the mean loss over the ranks; the highest stop signal if several came
        dist.all_reduce(loss)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    loss = loss.item() / run.world
    grad_norm = grad_norm.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # before the update: saved is good
        raise UserError(f"non-finite loss ({loss}) or gradient norm at step {run.step + 1}: "
                        "stopped before updating; the last checkpoint is kept (try a lower --lr)")
    run.optimizer.step()
    # DDP's gradients are views into its buckets: zeroed in place (None: copied, 4.9 GB at 1.2b)
    run.optimizer.zero_grad(set_to_none=run.world == 1)
    return loss, grad_norm, lr, int(stop.item())

# ---------------------------------------------------------------------------- evaluation
def bucket_sums(losses, target_counts, n_buckets):
    """Nats and tokens per bucket of the targets' training counts: 0, then [10^(j-1), 10^j)."""
    edges = 10 ** np.arange(n_buckets - 1, dtype=np.int64)  # 1, 10, 100, ...: exact integer bounds
    bucket = np.searchsorted(edges, np.asarray(target_counts), side="right")  # 0: 0, 1-9: 1, ...
    nats = np.bincount(bucket, weights=np.asarray(losses, dtype=np.float64), minlength=n_buckets)
    return nats, np.bincount(bucket, minlength=n_buckets)

def bucket_table(nats, tokens):
    """The paper's frequency-stratified table: {counts, tokens, loss, ppl} per bucket."""
    table = [dict(counts="0", tokens=int(tokens[0]), loss=None, ppl=None)]
    for j in range(1, len(tokens)):
        table.append(dict(counts=f"{10 ** (j - 1)}-{10 ** j - 1}", tokens=int(tokens[j]), loss=None,
                          ppl=None))
    for row, n in zip(table, nats):
        if row["tokens"]:  # else None
            row["loss"] = float(n / row["tokens"])
            row["ppl"] = math.exp(row["loss"])
    return table

@torch.no_grad()
def evaluate(run):
    """Loss, perplexity, bits per byte and the frequency table over the validation windows: each
    rank takes every world-th, one all_reduce adds the sums (raw_model: DDP's forward would add
    collectives)."""
    micro_batch = run.config.micro_batch
    n_buckets = 1 + len(str(max(1, int(run.counts.max()))))  # 0, then decades to the largest count
    sums = np.zeros(2 * n_buckets + 1)  # nats per bucket, tokens per bucket, bytes
    rank_windows = run.val[run.rank::run.world]
    for i in range(0, len(rank_windows), micro_batch):
        windows = rank_windows[i:i + micro_batch]
        # an uneven last batch padded with copies of its last window (losses dropped): one shape
        padded = windows + windows[-1:] * (micro_batch - len(windows))
        x, y, distinct = to_batch(padded, run.device, run.config.embedding == "lev")
        with precision(run.device, run.config.bf16):
            losses = run.raw_model(x, y, reduction="none", distinct=distinct)[:len(windows)]
        targets = y[:len(windows)].flatten().cpu().numpy()
        losses = losses.flatten().double().cpu().numpy()
        nats, tokens = bucket_sums(losses, run.counts[targets], n_buckets)
        sums += np.concatenate([nats, tokens, [run.byte_lengths[targets].sum()]])
    sums = torch.tensor(sums, dtype=torch.float64, device=run.device)
    if run.world > 1:
        dist.all_reduce(sums)
    sums = sums.cpu().numpy()
    nats, tokens, n_bytes = sums[:n_buckets], sums[n_buckets:-1], sums[-1]
    loss = nats.sum() / tokens.sum()
    bits_per_byte = nats.sum() / (math.log(2) * n_bytes)
    result = dict(val_loss=float(loss), val_ppl=math.exp(loss), val_bpb=float(bits_per_byte),
                  eval_tokens=int(tokens.sum()), buckets=bucket_table(nats, tokens))
    if run.rank == 0:  # rank 0 prints it, writes eval_step<N>.json and logs it
        lines = [f"eval step {run.step}: val loss {loss:.4f} | ppl {result['val_ppl']:.2f} | "
                 f"{result['val_bpb']:.4f} bits/byte | {result['eval_tokens']:,} tokens",
                 f"  {'train count':>13} {'tokens':>10} {'loss':>8} {'ppl':>12}"]
        for row in result["buckets"]:
            if row["tokens"]:
                lines.append(f"  {row['counts']:>13} {row['tokens']:>10,} {row['loss']:>8.4f} "
                             f"{row['ppl']:>12.2f}")
        say("\n".join(lines))
        record = dict(step=run.step, tokens_seen=run.step * run.config.batch_tokens, **result)
        write_json(os.path.join(run.config.out_dir, f"eval_step{run.step}.json"), record)
        log_record(run, dict(type="eval", **{k: v for k, v in record.items() if k != "buckets"}))
    return result

# ---------------------------------------------------------------------------- log and checkpoint
def say(text):
    """print, until stdout fails (`| head` done, a closed terminal); then nowhere: it trains on."""
    try:
        print(text, flush=True)
    except OSError:  # EPIPE or EIO
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

def log_record(run, record):
    with open(os.path.join(run.config.out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if run.wandb:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float))}
        run.wandb.log(numbers, step=record["step"])

def log_step(run, loss, grad_norm, lr, seconds, steps_done):
    tokens_per_s = steps_done * run.config.batch_tokens / seconds
    eta = (run.max_steps - run.step) * seconds / steps_done
    record = dict(type="train", step=run.step, loss=loss, lr=lr, grad_norm=grad_norm,
                  tokens_seen=run.step * run.config.batch_tokens, tokens_per_s=tokens_per_s,
                  eta_s=eta)
    line = (f"step {run.step}/{run.max_steps} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{tokens_per_s:,.0f} tok/s")
    if run.device.type == "cuda":  # reserved: what the allocator holds, what must fit the GPU
        record["peak_mem_gb"] = torch.cuda.max_memory_allocated(run.device) / 1e9
        record["peak_reserved_gb"] = torch.cuda.max_memory_reserved(run.device) / 1e9
        record["tflops"] = run.raw_model.flops_per_token() * tokens_per_s / run.world / 1e12
        line += (f" | peak mem {record['peak_mem_gb']:.1f} GB ({record['peak_reserved_gb']:.1f} "
                 f"reserved) | {record['tflops']:.0f} TFLOP/s per GPU")  # TFLOP/s: MFU x peak
    say(f"{line} | ETA {datetime.timedelta(seconds=round(eta))}")
    log_record(run, record)

# ckpt.pt is all a resume needs at any world size: the data position follows from the step.
def checkpoint(run):
    """Rank 0 writes ckpt.pt, renamed into place: a kill or a full disk keeps the previous one."""
    path = os.path.join(run.config.out_dir, "ckpt.pt")
    start = time.time()
    state = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                 model_config=asdict(run.raw_model.cfg), train_config=vars(run.config),
                 data_meta=run.meta, data=run.fingerprint, step=run.step,
                 tokens_seen=run.step * run.config.batch_tokens, wandb_id=run.wandb_id)
    atomic_write(path, lambda f: torch.save(state, f))
    size = os.path.getsize(path) / 1e9
    say(f"checkpoint: step {run.step}, {size:.2f} GB in {time.time() - start:.1f} s")

# ---------------------------------------------------------------------------- stopping
# SIGTERM: torchrun's, Kubernetes' and SLURM's end of a job; SIGUSR1: SLURM's `--signal` warning
# before the time limit; SIGHUP: the terminal closed. Each is a preemption: the step ends, the run
# saves and exits. Ctrl-C simply stops, losing the steps since the last checkpoint.
def on_signal(signum, frame):
    STOP["signal"] = STOP["signal"] or signum  # the loop saves at the end of this step

def shut_down(run, code, together=True):
    """code, once W&B is finished and the folder let go. Ranks that end together destroy NCCL's
    group; otherwise os._exit: gloo's teardown can hang (pytorch#56297), and a rank that leaves
    alone cannot tear the group down."""
    if run is not None and run.wandb:
        run.wandb.finish(exit_code=code)
    if run is not None and run.lock:  # the OS lets go at exit; main() may run again in-process
        run.lock.close()
    if not dist.is_initialized():
        return code
    if together:
        dist.barrier()
    if together and dist.get_backend() == "nccl":
        dist.destroy_process_group()
        return code
    sys.stdout.flush()  # os._exit skips it
    os._exit(code)

# ---------------------------------------------------------------------------- the loop
def main(argv):
    run = None
    try:
        run = set_up(argv)
        config = run.config
        due = run.step > 0 and (run.step % config.eval_interval == 0 or run.step == run.max_steps)
        evaluated = os.path.exists(os.path.join(config.out_dir, f"eval_step{run.step}.json"))
        if config.eval_only or due and not evaluated:
            evaluate(run)  # --eval_only; or the step's, which a kill or a preemption cut short
        if config.eval_only:
            return shut_down(run, 0)
        if 0 < config.stop_step <= run.step:  # a requeued job: the step asked is reached already
            if run.rank == 0:
                say(f"step {run.step}: --stop_step={config.stop_step} reached; nothing to train")
            return shut_down(run, 0)
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(signum, on_signal)
        seconds, steps_timed = 0.0, 0  # for tokens/s: the time in train_step since the last log
        while run.step < run.max_steps:
            start = time.time()
            loss, grad_norm, lr, preempted = train_step(run)
            run.step += 1
            seconds += time.time() - start
            steps_timed += 1
            last = run.step == run.max_steps
            stop = preempted or run.step == config.stop_step
            if run.rank == 0 and (run.step % config.log_interval == 0 or last or stop):
                log_step(run, loss, grad_norm, lr, seconds, steps_timed)
                seconds, steps_timed = 0.0, 0
            # saved before an evaluation: a kill during it (or its first compile) loses no step
            if run.rank == 0 and (run.step % config.ckpt_interval == 0 or last or stop):
                checkpoint(run)
            if (run.step % config.eval_interval == 0 or last) and not preempted:
                evaluate(run)
            if stop:
                why = signal.Signals(preempted).name if preempted else "--stop_step"
                if run.rank == 0:
                    say(f"stopped at step {run.step} ({why}); checkpoint saved: "
                        "add --resume to go on")
                return shut_down(run, 128 + preempted if preempted else 0)  # every rank alike
        if run.rank == 0:
            say(f"done: {run.step} steps; checkpoint {config.out_dir}/ckpt.pt")
        return shut_down(run, 0)
    except (OSError, ValueError) as e:  # a refusal (UserError), a path, a full disk: one line
        sys.stderr.write(f"error: {e}\n")  # one write: ranks' lines never run into each other
        return shut_down(run, 1, together=False)

if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored (`cmd &`)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C stops at once, without a traceback
    sys.exit(record(main)(sys.argv[1:]))  # record: torchrun names the rank a traceback ended
