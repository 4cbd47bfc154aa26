"""Train a Leviathan model (or a baseline) on prepare_data.py's token shards.

    python train.py --size=tiny                       # CPU, minutes (data/demo); then --resume or --eval_only
    torchrun --nproc_per_node=8 train.py --size=1.2b  # DDP; add --nnodes/--rdzv_* for several nodes

Options: --name=value for each key of OPTIONS, --flag or --no-flag for a yes/no one (--help: what each does).
"""
import argparse, datetime, importlib.util, json, math, os, re, signal, sys, time, uuid, zlib
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, fields
from types import SimpleNamespace
import numpy as np
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C in set-up ends the process, not in a traceback
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.elastic.multiprocessing.errors import record

from leviathan import EMBEDDINGS, Config, Model, distinct_ids, padded_vocab, precision
from prepare_data import UserError, atomic_write, hold_folder, open_prepared, prepare, print_error, write_json

# ---------------------------------------------------------------------------- the options and the sizes
OPTIONS = dict(  # name=(tiny's default, what it does); each size in SIZES sets its own values over these
    # the run
    size=("tiny", "a row of SIZES: tiny | 200m | 400m | 1.2b"),
    embedding=("lev", "lev (Leviathan) | tied (the paper's baseline) | untied (the ablation)"),
    data_dir=("data/demo", "prepare_data.py's output"),
    out_dir=("", "the run folder (\"\": out/<size>-<embedding>)"),
    # the model: leviathan.Config (vocab_size comes from the data)
    d_model=(128, "width D"),
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
    # the batch
    total_tokens=(2_703_360, "the run's length: steps = total_tokens // batch_tokens"),
    batch_tokens=(16 * 256, "tokens per step over all GPUs, whatever their number"),
    micro_batch=(16, "sequences per GPU per forward pass; accumulation makes up the rest"),
    # AdamW
    lr=(3e-3, "the backbone's peak learning rate"),
    lr_input=(None, "x lr for LEV or the input table (None: LR_SCALES)"),
    lr_head=(None, "x lr for the untied head (None: LR_SCALES)"),
    warmup_steps=(30, "linear warmup, then cosine decay to lr / 10"),
    weight_decay=(0.1, "on the matrices only; betas (0.9, 0.95), GPT-3's"),
    grad_clip=(1.0, "the gradients' largest global norm"),
    seed=(1337, "the model's init and the data order"),
    # evaluation, log, checkpoint
    eval_interval=(200, "evaluate every this many steps, and at the end"),
    eval_tokens=(1 << 16, "tokens evaluated: the first of the val split"),
    log_interval=(10, "log every this many steps, and at the end"),
    ckpt_interval=(200, "save ckpt.pt every this many steps, and at the end"),
    eval_only=(False, "evaluate out_dir/ckpt.pt, train nothing"),
    resume=(False, "continue from out_dir/ckpt.pt"),
    stop_step=(0, "save and exit at this step, the schedule unchanged (0: never)"),
    # the machine
    device=("auto", "auto (cuda if there is a GPU) | cpu | cuda"),
    compile=(None, "torch.compile (None: on CUDA only)"),
    bf16=(None, "bf16 autocast, LEV and the softmax in float32 (None: on CUDA only)"),
    bf16_allreduce=(False, "DDP's gradients in bf16, half the traffic (CUDA only)"),
    backend=("auto", "DDP's: auto (nccl on CUDA, gloo on CPU) | nccl | gloo (ranks sharing a GPU)"),
    deterministic=(False, "bit-identical reruns and resumes (CUDA: slower)"),
    wandb_project=("", "log to Weights & Biases there"),
)
DEFAULTS = {name: default for name, (default, sentence) in OPTIONS.items()}
# The paper's sizes and budgets; GPT-3/Pythia rates (it publishes none); heads of 128 dims (README, backbone)
PAPER = dict(data_dir="data/pile", seq_len=512, lev_heads=8, lev_rank=64, batch_tokens=512 * 512,
             micro_batch=16, warmup_steps=1000, eval_interval=1000, eval_tokens=1 << 22, ckpt_interval=1000)
SIZES = {  # each size: the options it sets over DEFAULTS
    "tiny": {},
    "200m": dict(PAPER, d_model=768, n_layer=7, n_head=6, total_tokens=4_200_000_000, lr=6e-4),
    "400m": dict(PAPER, d_model=1024, n_layer=15, n_head=8, total_tokens=8_400_000_000, lr=3e-4),
    "1.2b": dict(PAPER, d_model=2048, n_layer=16, n_head=16, total_tokens=24_100_000_000, lr=2e-4),
}
# (lr_input, lr_head) x lr per size and arm: the width sweep's best at D = 128, its power laws above it
LR_SCALES = {"tiny": {"lev": (0.1, 30.0), "tied": (30.0, 1.0), "untied": (1.0, 30.0)},
             "200m": {"lev": (0.1, 8.2), "tied": (13.0, 1.0), "untied": (1.0, 8.8)},
             "400m": {"lev": (0.1, 6.6), "tied": (12.0, 1.0), "untied": (1.0, 7.2)},
             "1.2b": {"lev": (0.1, 4.0), "tied": (10.0, 1.0), "untied": (1.0, 4.6)}}
# These may differ on --resume, and from rank to rank; every other option changes the loss curve.
RESUME_FREE = {"data_dir", "out_dir", "micro_batch", "eval_interval", "eval_tokens", "log_interval",
               "ckpt_interval", "eval_only", "resume", "stop_step", "device", "compile", "bf16",
               "bf16_allreduce", "backend", "deterministic", "wandb_project"}

def parse_args(argv):
    """--name=value options -> {name: value} for the options given (--resume must know which)."""
    parser = argparse.ArgumentParser(prog="train.py", usage="%(prog)s [--name=value]", description=__doc__,
                                     allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    kinds = {"lr_input": float, "lr_head": float, "compile": bool, "bf16": bool}  # their default is None
    for name, (default, sentence) in OPTIONS.items():
        kind = kinds.get(name, type(default))
        unless_given = dict(default=argparse.SUPPRESS, help=f"{sentence} (default {default!r})")
        if kind is bool:  # --flag, or --no-flag
            parser.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, **unless_given)
        else:
            parser.add_argument(f"--{name}", type=kind, **unless_given)
    return vars(parser.parse_args(argv))

def resolve(given, saved=None):
    """The config: the options given over the checkpoint's (resuming) or the size's and DEFAULTS, checked."""
    if saved is not None:
        if changed := sorted(k for k, v in given.items() if k not in RESUME_FREE and saved.get(k) != v):
            raise UserError("the checkpoint comes from a different config: " + ", ".join(
                f"{k}={saved.get(k)} there, {given[k]} here" for k in changed) + "; use another --out_dir")
        known = {k: v for k, v in saved.items() if k in DEFAULTS}
        c = SimpleNamespace(**{**DEFAULTS, **known, **given})
    else:
        size = given.get("size", "tiny")
        arm = given.get("embedding", "lev")
        lr_input, lr_head = LR_SCALES.get(size, {}).get(arm, (1.0, 1.0))  # unknown: refused below
        c = SimpleNamespace(**{**DEFAULTS, **SIZES.get(size, {}), "lr_input": lr_input, "lr_head": lr_head,
                               "out_dir": f"out/{size}-{arm}", **given})
    v = vars(c)
    choices = dict(size=SIZES, embedding=EMBEDDINGS, device=("auto", "cpu", "cuda"),
                   backend=("auto", "nccl", "gloo"))
    positive = ("seq_len", "total_tokens", "batch_tokens", "micro_batch", "lr", "lr_input", "lr_head",
                "grad_clip", "eval_interval", "eval_tokens", "log_interval", "ckpt_interval")
    rules = [(k, v[k] in allowed, f"one of {', '.join(allowed)}") for k, allowed in choices.items()]
    rules += [(k, 0 < v[k] < math.inf, "> 0") for k in positive]
    rules += [(k, 0 <= v[k] < math.inf, ">= 0") for k in ("warmup_steps", "weight_decay", "stop_step")]
    rules += [(k, v[k] != "", "a folder, not empty") for k in ("data_dir", "out_dir")]
    rules += [("seed", 0 <= c.seed < 2**63, "in [0, 2**63)"),
              ("total_tokens", c.total_tokens >= c.batch_tokens, "at least one step (--batch_tokens)"),
              ("lr_head", c.embedding != "tied" or c.lr_head == 1.0,
               "1 in the tied arm, whose table is the head; use --lr_input"),
              ("device", c.device != "cuda" or torch.cuda.is_available(), "cpu or auto: no CUDA GPU here"),
              ("bf16_allreduce", not c.bf16_allreduce or c.device != "cpu" and torch.cuda.is_available(),
               "false without CUDA GPUs (torch's bf16 hook: DDP takes it in CUDA builds only)"),
              ("wandb_project", not c.wandb_project or importlib.util.find_spec("wandb"),
               "empty without wandb: pip install wandb")]
    for name, good, rule in rules:
        if not good:
            raise UserError(f"--{name}={v[name]}: must be {rule}")
    return c

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
    # Only note it: main() checkpoints at the end of the step. A second Ctrl-C leaves at once, past exit hooks
    # (torch's can fail midway through a compile); a later SIGTERM (torchrun's, after a Ctrl-C) is ignored.
    again = signum == signal.SIGINT == STOP["signal"]
    if STOP["signal"] is not None and not again:
        return
    STOP["signal"] = signum
    note = "\ninterrupted\n" if again else f"\n{signal.Signals(signum).name}: saving a checkpoint\n"
    with suppress(OSError):  # no terminal any more (SIGHUP) or no reader: the save matters, not the note
        os.write(sys.stdout.fileno(), note.encode())  # not print, which a signal amid a print would re-enter
    if again:
        os._exit(128 + signum)

def say(text):
    """print, until stdout fails (`| head` done, a closed terminal); then nowhere: only signals stop a run."""
    try:
        print(text, flush=True)
    except OSError:  # EPIPE or EIO
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

# ---------------------------------------------------------------------------- set-up: device, DDP, data
def setup_device(config):
    """(device, rank, world size) from torchrun's variables (one process without them), the group joined."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:  # RANK left over in a shell: a rank outside the world would never save
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}: stale? Unset it, or use torchrun")
    if config.deterministic:  # cuBLAS repeats its sums only with a fixed workspace, set before its first use
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if config.device == "cpu" or config.device == "auto" and not torch.cuda.is_available():
        torch.set_flush_denormal(True)  # denormal floats (tiny Adam moments late in training) are slow on x86
        device = torch.device("cpu")
    else:  # TF32 off: under autocast the only float32 matmuls left are LEV's, float32 on purpose
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        join_ranks(config, device)
    return device, rank, world

def join_ranks(config, device):
    """The process group joined: NCCL's (a GPU per rank) or gloo's (CPUs, or ranks sharing a GPU)."""
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    node_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if backend == "nccl" and node_ranks > torch.cuda.device_count():
        raise UserError(f"{node_ranks} ranks on this node but {torch.cuda.device_count()} GPU(s): NCCL needs "
                        "a GPU per rank; --backend=gloo lets ranks share a GPU")
    if os.environ.get("RANK") == "0":  # torchrun's variables left in a shell would otherwise wait in silence
        say(f"waiting for {os.environ['WORLD_SIZE']} ranks at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')}")
    # 20 min for a collective's slowest rank: a first compile, or rank 0's 1.2b save (2.5 min at 100 MB/s)
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=20),
                            device_id=device if backend == "nccl" else None)

def agree(config, fingerprint, world):
    """One collective before DDP's first: every rank's loss-changing options and data are rank 0's."""
    ranks = [None] * world
    try:
        dist.all_gather_object(ranks, dict(vars(config), data=fingerprint))
    except RuntimeError:  # gloo's lost connection: a rank gone (NCCL waits, for torchrun to stop it)
        time.sleep(10)  # on its node, torchrun stops this rank meanwhile, and names the one that failed
        raise UserError("another rank stopped in its set-up: its own error line says why") from None
    for r, theirs in enumerate(ranks):  # a node given another --lr or data would otherwise train on, unseen
        differ = [k for k in theirs if k not in RESUME_FREE and theirs[k] != ranks[0][k]]
        if differ:
            raise UserError(f"rank {r} differs from rank 0 in {', '.join(differ)}: start every rank alike")

def open_data(config):
    """(meta, fingerprint, train, val, counts, byte_lengths), as Run declares them; shards read as used."""
    meta, splits, counts, byte_lengths = open_prepared(config.data_dir)
    fingerprint = {split: {os.path.basename(s.filename): [len(s), zlib.crc32(s[:4096].tobytes())]
                           for s in shards} for split, shards in splits.items()}  # length, crc32 of its start
    train = Windows(splits["train"], config.seq_len, config.seed)
    n_val = max(1, config.eval_tokens // config.seq_len)  # the val split's first windows, every eval
    starts = [(s, i * config.seq_len) for s in splits["val"] for i in range((len(s) - 1) // config.seq_len)]
    val = [s[start:start + config.seq_len + 1] for s, start in starts[:n_val]]
    if train.total == 0 or not val:
        raise UserError(f"the data is shorter than one window of seq_len + 1 = {config.seq_len + 1} tokens")
    return meta, fingerprint, train, val, counts, byte_lengths

class Windows:
    """Window p (the data position, the same at any world size): a seeded shuffle per epoch, of the shards
    then of their windows of seq_len + 1 tokens every seq_len (little memory)."""
    def __init__(self, shards, seq_len, seed):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        self.sizes = np.array([(len(s) - 1) // seq_len for s in shards])  # windows per shard
        self.total = int(self.sizes.sum())
        self.epoch = self.shard = None  # the shuffles in use; consecutive windows share them
    def __getitem__(self, p):
        epoch, q = divmod(p, self.total)  # window q of an epoch
        if self.epoch != epoch:  # the epoch's shard order, and where each shard's windows end in it
            self.epoch = epoch
            self.shard = None
            self.shard_order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            self.ends = np.cumsum(self.sizes[self.shard_order])
        k = int(np.searchsorted(self.ends, q, side="right"))  # the epoch's k-th shard holds window q
        shard = self.shard_order[k]
        if self.shard != shard:  # the shard's window order in this epoch
            self.shard = shard
            rng = np.random.default_rng([self.seed, epoch, shard])
            self.window_order = rng.permutation(self.sizes[shard])
        first = self.ends[k] - self.sizes[shard]  # the epoch's first window from this shard
        start = int(self.window_order[q - first]) * self.seq_len
        return self.shards[shard][start:start + self.seq_len + 1]  # its ids checked as read

def keep_log_until(path, step):
    """log.jsonl's records up to a resumed checkpoint, a kill may have left later ones or a cut line."""
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
    return sorted(n for n in names if re.fullmatch(r"ckpt\.pt|config\.json|log\.jsonl|eval_step\d+\.json", n))

def load_checkpoint(path, keys=("model", "optimizer", "model_config", "train_config", "data_meta", "step")):
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
    if unknown := ", ".join(k for k, v in ckpt.get("train_config", {}).items() if k not in DEFAULTS and v):
        raise UserError(f"{path} was trained with options this train.py lacks ({unknown}): read it with the "
                        "command that trained it (a newer train.py, experiments.lev_variants), or train anew")
    return ckpt

def check_fit(ckpt, path, config, meta, fingerprint):
    """A checkpoint comes from this tokenizer's data and, resuming, this very data (--eval_only: any data)."""
    trained, keys = ckpt["data_meta"], ("tokenizer", "tokenizer_vocab_size", "vocab_size", "eot_id")
    if any(trained.get(k) != meta.get(k) for k in keys):
        raise UserError(f"{path} was trained on another tokenizer's data ({trained.get('vocab_size')} ids) "
                        f"than {config.data_dir} ({meta['vocab_size']} ids): use the data it was trained on")
    if config.resume and ckpt["data"] != fingerprint:
        raise UserError(f"the data in {config.data_dir} changed since {path} was saved (shards, lengths or "
                        "first tokens): resume on its own data, or start anew in another --out_dir")

def build(config, model_cfg, device, world, ckpt):
    """(raw_model, model, optimizer), restored when resuming; compiled in place: the state_dict keys stay."""
    cuda = device.type == "cuda"
    torch.manual_seed(config.seed)
    raw_model = Model(model_cfg).to(device)
    optimizer = raw_model.configure_optimizers(config.lr, config.weight_decay, fused=cuda,
                                               lr_input=config.lr_input, lr_head=config.lr_head)
    if ckpt is not None:  # no RNG state to restore: after the init above, no step draws a random number
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])  # moves the moments onto the parameters' device
    if config.compile or config.compile is None and cuda:  # None: on CUDA only
        raw_model.compile()
    if world == 1:
        return raw_model, raw_model, optimizer
    model = torch.nn.parallel.DistributedDataParallel(raw_model, device_ids=[device] if cuda else None,
                                                      gradient_as_bucket_view=True)  # no second copy
    if config.bf16_allreduce:
        model.register_comm_hook(None, bf16_compress_hook)
    return raw_model, model, optimizer

@dataclass(kw_only=True)
class Run:
    """What one process holds, in set_up's order: the config, the data, the processes, the model, the loop."""
    config: SimpleNamespace  # the options, resolved: given, over the checkpoint's or the size's and DEFAULTS
    meta: dict  # the data folder's meta.json
    fingerprint: dict  # each shard's length and the crc32 of its start: a resume compares it
    train: Windows  # the training windows, by their place in the data order
    val: list  # the validation windows: the same at every evaluation
    counts: np.ndarray  # each id's count in the training split: the frequency table's buckets
    byte_lengths: np.ndarray  # each id's UTF-8 bytes: bits per byte
    device: torch.device
    rank: int  # this process, of `world` (torchrun's RANK and WORLD_SIZE)
    world: int
    raw_model: Model  # the module saved and optimised; its cfg, the shape (its vocabulary the data's)
    model: torch.nn.Module  # what the step runs: raw_model, or DDP's wrapper around it
    optimizer: torch.optim.Optimizer
    lev: bool  # LEV's distinct ids are found with each batch (to_batch)
    step: int  # optimizer steps done
    max_steps: int
    accum: int  # micro-steps per step on this rank
    wandb_id: str  # kept in the checkpoint: a --resume continues the same W&B run
    wandb: object = None  # rank 0's W&B run, with --wandb_project
    lock: object = None  # rank 0's hold on out_dir (prepare_data.hold_folder)

def open_outputs(run, params):
    """Rank 0's: its folder made (all else being right) and held, the run described, config.json, W&B."""
    config, outputs = run.config, dict(train=vars(run.config), model=asdict(run.raw_model.cfg))
    os.makedirs(config.out_dir, exist_ok=True)
    run.lock = hold_folder(config.out_dir)  # one process per run: two --resume of it would both train
    say(f"config: {json.dumps(outputs['train'])}\nmodel: {json.dumps(outputs['model'])}")
    say(f"parameters: {', '.join(f'{k} {v:,}' for k, v in params.items())}; {run.world} x {run.device.type}, "
        f"{run.accum} micro-steps of {config.micro_batch} x {config.seq_len} per step")
    if run.world > 1:  # the hook as DDP itself reports it (the acceptance run checks it for --bf16_allreduce)
        hook = run.model._get_ddp_logging_data().get("comm_hook") or "none (float32 all-reduce)"
        say(f"DDP: {run.world} ranks on {dist.get_backend()}, gradient comm hook {hook}")
    if not config.eval_only:
        write_json(os.path.join(config.out_dir, "config.json"), outputs)
    if config.resume:
        keep_log_until(os.path.join(config.out_dir, "log.jsonl"), run.step)
    if config.wandb_project:  # one W&B run over every --resume: its id is kept in the checkpoint
        import wandb
        run.wandb = wandb.init(project=config.wandb_project, name=config.out_dir, id=run.wandb_id,
                               resume="allow", config=dict(outputs, params=params))

def set_up(argv):
    """The run: every check that can refuse it, in order, before anything is written; then its state."""
    given = parse_args(argv)
    config = resolve(given)  # also fixes the default out_dir
    path = os.path.join(config.out_dir, "ckpt.pt")
    loading = config.resume or config.eval_only
    written = run_files(config.out_dir)
    if written and not loading:  # a new run would start over them
        raise UserError(f"{config.out_dir} holds another run's {', '.join(written)}: pass --resume "
                        "to continue it (from its ckpt.pt), or choose another --out_dir")
    device, rank, world = setup_device(config)
    if world == 1 and config.data_dir == "data/demo" and not os.path.exists("data/demo/meta.json"):
        say("no prepared data in data/demo: preparing it, as `python prepare_data.py --dataset=demo` does")
        prepare(["--dataset=demo"])
    ckpt = None
    if loading:
        ckpt = load_checkpoint(path)
        config = resolve(given, ckpt["train_config"])
    meta, fingerprint, train, val, counts, byte_lengths = open_data(config)
    model_cfg = model_config(config, meta["vocab_size"])
    if loading:
        check_fit(ckpt, path, config, meta, fingerprint)
    if config.eval_only and ckpt["data"] != fingerprint:  # data the run never saw: its results apart
        config.out_dir += "/eval-" + os.path.basename(os.path.abspath(config.data_dir))
    per_micro_step = world * config.micro_batch * config.seq_len
    if config.batch_tokens % per_micro_step:
        raise UserError(f"batch_tokens={config.batch_tokens:,} does not divide over world size {world} x "
                        f"micro_batch {config.micro_batch} x seq_len {config.seq_len} = {per_micro_step:,}")
    if world > 1:  # before DDP's first collective, which would break on a rank gone, or train on what differs
        agree(config, fingerprint, world)
    raw_model, model, optimizer = build(config, model_cfg, device, world, ckpt)
    run = Run(config=config, meta=meta, fingerprint=fingerprint, train=train, val=val, counts=counts,
              byte_lengths=byte_lengths, device=device, rank=rank, world=world, raw_model=raw_model,
              model=model, optimizer=optimizer, max_steps=config.total_tokens // config.batch_tokens,
              lev=config.embedding == "lev", accum=config.batch_tokens // per_micro_step,
              step=ckpt["step"] if ckpt else 0, wandb_id=(ckpt or {}).get("wandb_id") or uuid.uuid4().hex[:8])
    if rank == 0:
        open_outputs(run, raw_model.param_counts())
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
    """(inputs, targets, distinct) on the device, LEV's distinct_ids found on the CPU: no wait for the GPU."""
    xy = torch.from_numpy(np.stack(windows).astype(np.int64))
    distinct = distinct_ids(xy[:, :-1]) if lev else ()
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
        distinct = [part.pin_memory().to(device, non_blocking=True) for part in distinct]
    return xy[:, :-1], xy[:, 1:], tuple(distinct) or None

def accumulate_gradients(run):
    """The summed losses of this rank's micro-batches, gradients accumulated: rank r's micro-step m reads the
    step's slice r * accum + m of micro_batch windows, so any world size trains on the same batch."""
    micro_batch = run.config.micro_batch
    step_start = run.step * (run.config.batch_tokens // run.config.seq_len)  # the windows of earlier steps
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = step_start + (run.rank * run.accum + micro) * micro_batch
        windows = [run.train[p] for p in range(first, first + micro_batch)]
        x, y, distinct = to_batch(windows, run.device, run.lev)
        sync = run.world == 1 or micro == run.accum - 1  # all-reduce the gradients once, after the last
        with precision(run.device, run.config.bf16), (nullcontext() if sync else run.model.no_sync()):
            loss = run.model(x, y, distinct=distinct)
        (loss / run.accum).backward()  # the gradient of the mean over the step's micro-batches
        loss_sum += loss.detach()
    return loss_sum

def train_step(run):
    """One optimizer step: (loss, grad_norm, stop), stop the signal that reached any rank, or None."""
    lr = lr_at(run.step, run.config, run.max_steps)
    for group in run.optimizer.param_groups:  # each group's lr_scale: see Model.configure_optimizers
        group["lr"] = lr * group["lr_scale"]
    loss_sum = accumulate_gradients(run)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.config.grad_clip)
    # The mean loss, and any rank's stop signal (the highest if several): all ranks stop and exit alike
    loss = loss_sum / run.accum
    stop = torch.tensor(STOP["signal"] or 0, device=run.device)
    if run.world > 1:
        dist.all_reduce(loss)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    loss, grad_norm, stop = loss.item() / run.world, grad_norm.item(), int(stop.item()) or None
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise UserError(f"non-finite loss ({loss}) or gradient norm at step {run.step + 1}: "
                        "stopped without updating; the last good checkpoint is kept (try a lower --lr)")
    run.optimizer.step()
    # DDP's gradients are views into its buckets, so zeroed in place (set to None: copied, 4.9 GB at 1.2b)
    run.optimizer.zero_grad(set_to_none=run.world == 1)
    return loss, grad_norm, stop

def log_record(run, record):
    with open(os.path.join(run.config.out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    if run.wandb:
        run.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])

def log_step(run, loss, grad_norm, seconds, steps_done):
    tokens_per_s = steps_done * run.config.batch_tokens / seconds
    eta = (run.max_steps - run.step) * seconds / steps_done
    lr = lr_at(run.step - 1, run.config, run.max_steps)
    record = dict(type="train", step=run.step, loss=loss, lr=lr, grad_norm=grad_norm,
                  tokens_seen=run.step * run.config.batch_tokens, tokens_per_s=tokens_per_s, eta_s=eta)
    line = f"step {run.step}/{run.max_steps} | loss {loss:.4f} | lr {lr:.2e} | {tokens_per_s:,.0f} tok/s"
    if counters["stats"]["unique_graphs"]:  # compiled: graphs so far and graph breaks met, soon constant
        record.update(graphs=counters["stats"]["unique_graphs"],
                      graph_breaks=sum(counters["graph_break"].values()))
    if run.device.type == "cuda":  # reserved: what the allocator holds, the figure that must fit the GPU
        record.update(peak_mem_gb=torch.cuda.max_memory_allocated(run.device) / 1e9,
                      peak_reserved_gb=torch.cuda.max_memory_reserved(run.device) / 1e9)
        line += f" | peak mem {record['peak_mem_gb']:.1f} GB ({record['peak_reserved_gb']:.1f} reserved)"
        record["tflops"] = run.raw_model.flops_per_token() * tokens_per_s / run.world / 1e12  # MFU x peak
        line += f" | {record['tflops']:.0f} TFLOP/s per GPU"
    say(f"{line} | ETA {datetime.timedelta(seconds=round(eta))}")
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
    micro_batch = run.config.micro_batch
    n_buckets = 1 + len(str(max(1, int(run.counts.max()))))  # 0, then the decades up to the largest count
    nats, tokens, n_bytes = np.zeros(n_buckets), np.zeros(n_buckets), 0
    rank_windows = run.val[run.rank::run.world]
    for i in range(0, len(rank_windows), micro_batch):
        windows = rank_windows[i:i + micro_batch]
        # An uneven last batch is padded with copies of its last window (losses dropped): one shape, compiled
        x, y, distinct = to_batch(windows + windows[-1:] * (micro_batch - len(windows)), run.device, run.lev)
        with precision(run.device, run.config.bf16):
            losses = run.raw_model(x, y, reduction="none", distinct=distinct)[:len(windows)]
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
    say(f"eval step {run.step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
         f"{result['val_bpb']:.4f} bits/byte | {result['eval_tokens']:,} tokens\n"
         f"  {'train count':>13} {'tokens':>10} {'loss':>8} {'ppl':>12}" + "".join(
             f"\n  {row['counts']:>13} {row['tokens']:>10,} {row['loss']:>8.4f} {row['ppl']:>12.2f}"
             for row in result["buckets"] if row["tokens"]))
    record = dict(step=run.step, tokens_seen=run.step * run.config.batch_tokens, **result)
    write_json(os.path.join(run.config.out_dir, f"eval_step{run.step}.json"), record)
    log_record(run, dict(type="eval", **{k: v for k, v in record.items() if k != "buckets"}))
    return result

# ---------------------------------------------------------------------------- checkpoints
# ckpt.pt is all a resume needs at any world size: the data position follows from the step; no RNG state.
def checkpoint(run):
    """Rank 0 writes ckpt.pt; a failed write (a full disk) is an error that keeps the previous one whole."""
    path, start = os.path.join(run.config.out_dir, "ckpt.pt"), time.time()
    state = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),  # tied table: once
                 model_config=asdict(run.raw_model.cfg), train_config=vars(run.config), data_meta=run.meta,
                 data=run.fingerprint, step=run.step, tokens_seen=run.step * run.config.batch_tokens,
                 wandb_id=run.wandb_id)
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as e:  # no space left: torch.save raises either
        if isinstance(e, RuntimeError) and "PytorchStreamWriter" not in str(e):
            raise  # not the write: a CUDA error (copying the weights off the GPU) is reported as itself
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise UserError(f"could not write {path} ({reason}); the previous checkpoint is kept") from None
    say(f"checkpoint: step {run.step}, {os.path.getsize(path) / 1e9:.2f} GB in {time.time() - start:.1f} s")

def shut_down(run, code, together=True):
    """Returns code, W&B finished; ranks ending together destroy NCCL's group. Else os._exit: gloo's teardown
    can hang (pytorch#56297), and a rank leaving alone cannot tear the group down."""
    if run is not None and run.wandb:
        run.wandb.finish(exit_code=code)
    if run is not None and run.lock:  # the OS lets go at exit; main() may run again in this process
        run.lock.close()
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
        final = os.path.join(config.out_dir, f"eval_step{run.max_steps}.json")  # missing: a kill cut it short
        if config.eval_only or run.step == run.max_steps and not os.path.exists(final):
            evaluate(run)
        if config.eval_only:
            return shut_down(run, 0)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(signum, on_signal)
        seconds, steps_timed = 0.0, 0  # for tokens/s: the time in train_step since the last log line
        while run.step < run.max_steps:
            start = time.time()
            loss, grad_norm, preempted = train_step(run)  # preempted: the signal that reached some rank
            run.step += 1
            seconds += time.time() - start
            steps_timed += 1
            last = run.step == run.max_steps
            stop = preempted or run.step == config.stop_step
            if run.rank == 0 and (run.step % config.log_interval == 0 or last or stop):
                log_step(run, loss, grad_norm, seconds, steps_timed)
                seconds, steps_timed = 0.0, 0
            # The save before an evaluation: a kill during it (or its first compile) then loses no step
            if run.rank == 0 and (run.step % config.ckpt_interval == 0 or last or stop):
                checkpoint(run)
            if (run.step % config.eval_interval == 0 or last) and not preempted:  # preempted: just save
                evaluate(run)
            if stop:
                why = signal.Signals(preempted).name if preempted else f"--stop_step={config.stop_step}"
                if run.rank == 0:
                    say(f"stopped at step {run.step} ({why}); checkpoint saved: add --resume to go on")
                return shut_down(run, 128 + preempted if preempted else 0)  # all ranks alike: one status
        if run.rank == 0:
            say(f"done: {run.step} steps; checkpoint {config.out_dir}/ckpt.pt")
        return shut_down(run, 0)
    except (UserError, OSError) as e:  # bad input, or the environment's (a path under a file, a full disk)
        print_error(e)  # by the rank that met it; torchrun stops the others, naming it
        return shut_down(run, 1, together=False)

if __name__ == "__main__":
    sys.exit(record(main)(sys.argv[1:]))  # record: torchrun names the rank a traceback ended
