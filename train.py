"""Train a Leviathan model (or one of its two baselines) on token shards from prepare_data.py.

    python train.py --size=tiny --dataset=demo                 # CPU, a few minutes
    python train.py --size=200m --embedding=tied               # one GPU
    torchrun --nproc_per_node=8 train.py --size=1.2b           # DDP; add --nnodes/--rdzv_* for several nodes
    python train.py --size=200m --resume                       # continue out/200m-lev exactly
    python train.py --size=200m --eval_only                    # evaluate its checkpoint

Every field of TrainConfig is an option, --name=value (a bare --flag means true). Fields left at
None take the value of the chosen --size, from leviathan.SIZES: the model's shape, the training
defaults and each arm's learning-rate multipliers. `python train.py --help` lists them all.

Read top to bottom: the options; the set-up (device, DDP, data), where every check that can
refuse a run comes before any work; the model and optimizer; the loop; the evaluation. A run's
checkpoint, preemption signals and the ranks' agreement on a failure are in checkpoint.py.
"""
import argparse, dataclasses, datetime, inspect, json, math, os, re, signal, sys, time, types
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist

from checkpoint import (STOP, STOP_SIGNALS, CheckpointWriter, check_checkpoint, checkpoint, failed_rank, keep_log_until,
                        load_checkpoint, on_signal, shut_down)
from cli import ArgumentParser, UserError, add_dataclass_options, print_error
from data import Windows, bucket_sums, bucket_table, open_data, tokenizer_from_meta, val_windows, write_json
from leviathan import EMBEDDINGS, SIZES, Config, Model, Preset, padded_vocab


# ---------------------------------------------------------------------------- options


@dataclass
class TrainConfig:  # each field's comment is its option's --help
    # what to train, on what
    size: str = "tiny"  # tiny | 200m | 400m | 1.2b (leviathan.SIZES)
    embedding: str = "lev"  # lev (Leviathan) | tied (the paper's baseline) | untied (ablation)
    dataset: str | None = None  # reads data/<dataset>/ (prepare_data.py); tiny: demo, others: pile
    data_dir: str = ""  # a data folder given directly (overrides --dataset)
    out_dir: str = ""  # default out/<size>-<embedding>
    # model shape: None keeps the size preset (vocab_size always comes from the data)
    d_model: int | None = None  # model width D
    n_layer: int | None = None  # Transformer blocks
    n_head: int | None = None  # attention heads
    seq_len: int | None = None  # tokens per training sequence (the context)
    rope_theta: float | None = None  # rotary base
    lev_digits: int | None = None  # LEV: k, digits per id
    lev_seed_dim: int | None = None  # LEV: d_seed, the seed's width
    lev_heads: int | None = None  # LEV: h heads
    lev_knots: int | None = None  # LEV: kappa, B-spline knots
    lev_rank: int | None = None  # LEV: r, modes per head
    lev_sigmoid_scale: float | None = None  # LEV: t = sigmoid(scale * u), the paper's 1/2; 1 as in the study
    # budget, batch and optimiser
    total_tokens: int | None = None  # training tokens; steps = total_tokens // batch_tokens
    batch_tokens: int | None = None  # tokens per optimizer step, over all GPUs (fixed whatever the world size)
    micro_batch: int | None = None  # sequences per GPU per forward pass; accumulation fills the rest
    lr: float | None = None  # peak learning rate of the backbone
    lr_input: float | None = None  # x lr for the input side (LEV, or the table); None: the size's lr_scales
    lr_head: float | None = None  # x lr for the untied head (lev, untied); None: the size's lr_scales
    warmup_steps: int | None = None  # steps of linear warmup
    min_lr_frac: float = 0.1  # cosine decay ends at min_lr_frac * lr
    weight_decay: float = 0.1  # on the backbone and head matrices only (Model.configure_optimizers)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # largest gradient norm
    seed: int = 1337  # model init and data order
    # evaluation, logging, checkpoints
    eval_interval: int | None = None  # steps between evaluations (and one at the end)
    eval_tokens: int | None = None  # validation tokens evaluated (the first ones of the val split)
    log_interval: int = 10  # steps between log lines
    ckpt_interval: int | None = None  # steps between checkpoints (and one at the end)
    eval_only: bool = False  # evaluate out_dir/ckpt.pt and exit
    resume: bool = False  # continue from out_dir/ckpt.pt
    stop_step: int = 0  # save and exit after this step, schedule unchanged (0: run to the end)
    # hardware
    device: str = "auto"  # auto | cpu | cuda
    compile: bool | None = None  # torch.compile; None: on for CUDA, off for CPU
    bf16: bool | None = None  # bf16 autocast (LEV and the loss stay float32); None: on for CUDA, off for CPU
    bf16_allreduce: bool = False  # DDP: all-reduce gradients in bf16, half the traffic (for several nodes)
    deterministic: bool = False  # deterministic kernels: bit-identical reruns and resumes (CUDA: slower)
    wandb_project: str = ""  # log to Weights & Biases (needs `pip install wandb`)
    wandb_run_name: str = ""  # the run's name there

    def __post_init__(self):
        """Refuse out-of-range values before any work starts; None means "from the size" and is
        checked once resolve() has filled it in. Model shapes are leviathan.Config's to check."""
        for name, (allowed, rule) in RULES.items():
            value = getattr(self, name)
            if value is not None and not allowed(value):
                raise UserError(f"--{name}={value}: must be {rule}")
        if self.wandb_run_name and not self.wandb_project:
            raise UserError("--wandb_run_name needs --wandb_project")


def finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


# What each option may be: a test, and the rule as the error states it.
RULES = {
    "size": (lambda v: v in SIZES, f"one of {', '.join(SIZES)} (the model presets)"),
    "embedding": (lambda v: v in EMBEDDINGS, f"one of {', '.join(EMBEDDINGS)} (the three arms)"),
    "dataset": (lambda v: v != "", "a name under data/ (what prepare_data.py wrote)"),
    "device": (lambda v: v in ("auto", "cpu", "cuda"), "auto, cpu or cuda"),
    **{name: (lambda v: v >= 1, ">= 1") for name in ("total_tokens", "batch_tokens", "micro_batch", "eval_interval",
                                                     "eval_tokens", "log_interval", "ckpt_interval")},
    **{name: (lambda v: v >= 0, ">= 0") for name in ("warmup_steps", "stop_step")},
    **{name: (lambda v: finite(v) and v > 0, "> 0") for name in ("lr", "lr_input", "lr_head", "grad_clip")},
    "min_lr_frac": (lambda v: finite(v) and 0 <= v <= 1, "in [0, 1] (the final fraction of --lr)"),
    "weight_decay": (lambda v: finite(v) and v >= 0, ">= 0 (a negative decay would grow the weights)"),
    "beta1": (lambda v: finite(v) and 0 <= v < 1, "in [0, 1) (AdamW's first-moment decay)"),
    "beta2": (lambda v: finite(v) and 0 <= v < 1, "in [0, 1) (AdamW's second-moment decay)"),
    "seed": (lambda v: 0 <= v < 2**63, "in [0, 2^63)"),
}


MODEL_FIELDS = [f.name for f in dataclasses.fields(Config) if f.name not in ("vocab_size", "embedding")]
TRAIN_FIELDS = [f.name for f in dataclasses.fields(Preset) if f.name not in ("model", "lr_scales")]  # the preset's rest
# On --resume these may change freely; every other field changes the loss curve and must match.
RESUME_FREE = {"dataset", "data_dir", "out_dir", "micro_batch", "eval_interval", "eval_tokens", "log_interval",
               "ckpt_interval", "eval_only", "resume", "stop_step", "device", "compile", "bf16", "bf16_allreduce",
               "deterministic", "wandb_project", "wandb_run_name"}


def parse_args(argv):
    """--name=value options -> {field: value} for the fields given (--resume must know which)."""
    parser = ArgumentParser("train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_options(parser, TrainConfig, none_means="from --size")
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
    if config.embedding == "tied" and config.lr_head not in (None, 1.0):
        raise UserError("--lr_head: the tied arm has no separate head (its table is the head); use --lr_input")
    preset = SIZES[config.size]
    lr_input, lr_head = preset.lr_scales[config.embedding]
    defaults = {**{k: getattr(preset, k) for k in TRAIN_FIELDS}, "lr_input": lr_input, "lr_head": lr_head,
                **{k: getattr(preset.model, k) for k in MODEL_FIELDS},
                "out_dir": os.path.join("out", f"{config.size}-{config.embedding}")}
    config = dataclasses.replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) in (None, "")})
    model_config(config, {"vocab_size": preset.model.vocab_size})  # the model's shape rules, before any work
    return config


def model_config(config, meta):
    try:
        return Config(vocab_size=padded_vocab(meta["vocab_size"]), embedding=config.embedding,
                      **{k: getattr(config, k) for k in MODEL_FIELDS})
    except ValueError as e:  # Config's own words, as an option: "lev_knots=1: ..." -> "--lev_knots=1: ..."
        raise UserError(f"--{e}") from None


# ---------------------------------------------------------------------------- set-up: device, DDP, data


class Run(types.SimpleNamespace):
    """Everything the loop needs, in one place. raw_model is the plain module (saved, counted,
    optimised); model is the form that runs it: compiled, and wrapped in DDP across ranks."""


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


def open_run(argv):
    """Every check that can refuse the run, in order, before anything is written; then the Run."""
    given = parse_args(argv)
    config = resolve(given)  # also fixes the default out_dir
    path = os.path.join(given.get("out_dir") or config.out_dir, "ckpt.pt")
    loading = config.resume or config.eval_only
    if loading and not os.path.exists(path):
        raise UserError(f"no checkpoint {path} to {'resume' if config.resume else 'evaluate'}; "
                        "train first (without --resume), or pass the run's --out_dir")
    if not loading and os.path.exists(path):
        raise UserError(f"{path} exists: pass --resume to continue that run, or choose another --out_dir")
    device, rank, world = setup_device(config)
    ckpt = load_checkpoint(path, ("model", "optimizer", "model_config", "train_config", "data_meta", "step",
                                  "data_position", "rng_cpu")) if loading else None
    if ckpt is not None:
        config = resolve(given, ckpt["train_config"])
    meta, splits, counts = open_data(config)
    model_cfg = model_config(config, meta)
    if ckpt is not None:
        check_checkpoint(ckpt, model_cfg, meta, path)
    per_step = world * config.micro_batch * config.seq_len
    if config.batch_tokens % per_step:
        raise UserError(f"batch_tokens={config.batch_tokens:,} does not divide over world size {world} x micro_batch "
                        f"{config.micro_batch} x seq_len {config.seq_len} = {per_step:,}; use a multiple of it")
    if config.total_tokens < config.batch_tokens:
        raise UserError(f"total_tokens={config.total_tokens:,} is less than one step of "
                        f"batch_tokens={config.batch_tokens:,}")
    train = Windows(splits["train"], config.seq_len, config.seed)
    val = val_windows(splits["val"], config.seq_len, max(1, config.eval_tokens // config.seq_len))
    if train.total == 0 or not val:
        raise UserError(f"the data is shorter than one window of seq_len + 1 = {config.seq_len + 1} tokens")
    if config.wandb_project and rank == 0:
        try:
            import wandb  # noqa: F401  (checked now, started once the run folder exists)
        except ImportError:
            raise UserError("--wandb_project needs wandb: pip install wandb") from None
    if rank == 0:  # the last check: the run folder is made only once everything else is right
        try:
            os.makedirs(config.out_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f"--out_dir={config.out_dir}: cannot create it ({e.strerror})") from None
    return Run(config=config, model_config=model_cfg, meta=meta, counts=counts, ckpt=ckpt, train=train, val=val,
               device=device, rank=rank, world=world, accum=config.batch_tokens // per_step,
               step_windows=config.batch_tokens // config.seq_len, max_steps=config.total_tokens // config.batch_tokens,
               wandb=None, byte_lengths=tokenizer_from_meta(meta).token_byte_lengths(),
               # count 0, then as many decades (1-9, 10-99, ...) as the most frequent token needs
               n_buckets=1 + len(str(max(1, int(counts.max())))))


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
    wire. (torch's own bf16 hook insists on NCCL; this one also runs under gloo, so it is tested.)"""
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
    run.start_step = run.start_position = 0
    run.writer = CheckpointWriter()
    if run.ckpt is not None:
        run.raw_model.load_state_dict(run.ckpt["model"])
        run.optimizer.load_state_dict(run.ckpt["optimizer"])  # moves the moments onto the parameters' device
        torch.set_rng_state(run.ckpt["rng_cpu"])
        states = run.ckpt.get("rng_cuda")  # one per rank; on another number of GPUs rank r takes r mod their count
        if cuda and states:
            torch.cuda.set_rng_state(states[run.rank % len(states)])
        run.start_step, run.start_position = run.ckpt["step"], run.ckpt["data_position"]
        run.ckpt = None  # nothing else is needed: let the full state dict go
    bf16 = config.bf16 if config.bf16 is not None else cuda
    run.autocast = torch.autocast(run.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    if config.compile if config.compile is not None else cuda:
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
    run.flops_per_token = run.raw_model.flops_per_token()


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
        keep_log_until(os.path.join(config.out_dir, "log.jsonl"), run.start_step)
    if config.wandb_project:
        import wandb
        run.wandb = wandb.init(project=config.wandb_project, name=config.wandb_run_name or None, resume="allow",
                               config=dict(train=asdict(config), model=asdict(model_cfg), params=counts))


# ---------------------------------------------------------------------------- the loop


def lr_at(step, config, max_steps):
    """Linear warmup to lr, then cosine decay to min_lr_frac * lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, max_steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_frac + (1 - config.min_lr_frac) * cosine)


def to_batch(windows, device):
    xy = torch.from_numpy(np.stack(windows).astype(np.int64))
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    return xy[:, :-1], xy[:, 1:]


def train_step(run, step, position):
    """One optimizer step over batch_tokens. Rank r's micro-step m takes the fixed slice
    (r * accum + m) of the step's windows, so the batch is the same for any world size."""
    micro_batch = run.config.micro_batch
    for group in run.optimizer.param_groups:  # each group's lr_scale: see Model.configure_optimizers
        group["lr"] = lr_at(step, run.config, run.max_steps) * group["lr_scale"]
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        first = position + (run.rank * run.accum + micro) * micro_batch
        x, y = to_batch([run.train[p] for p in range(first, first + micro_batch)], run.device)
        last = micro == run.accum - 1  # all-reduce the gradients once, after the last micro-step
        with run.autocast, (run.model.no_sync() if run.world > 1 and not last else nullcontext()):
            loss = run.model(x, y)
        (loss / run.accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.config.grad_clip)
    # One all_reduce for the mean loss and "did any rank get a signal", so all ranks stop together.
    shared = torch.stack([loss_sum / run.accum, torch.tensor(float(STOP["signal"] is not None), device=run.device)])
    if run.world > 1:
        dist.all_reduce(shared)
    loss, stop, grad_norm = shared[0].item() / run.world, shared[1].item() > 0, grad_norm.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise UserError(f"non-finite loss ({loss}) or gradient norm at step {step + 1}: stopped without updating; "
                        "the last good checkpoint is kept (try a lower --lr)")
    run.optimizer.step()
    # Under DDP the gradients are views into its all-reduce buckets: zeroed in place they stay so, and
    # every micro-step accumulates into the buckets. Set to None, the no_sync micro-steps would make
    # fresh gradients beside the buckets (a second copy: 4.9 GB at 1.2b) for DDP to copy in at the end.
    run.optimizer.zero_grad(set_to_none=run.world == 1)
    return loss, grad_norm, stop


def log_step(run, step, loss, grad_norm, seconds, steps_done):
    tokens_per_s = steps_done * run.config.batch_tokens / seconds
    eta = (run.max_steps - step) * seconds / steps_done
    record = dict(type="train", step=step, loss=loss, lr=lr_at(step - 1, run.config, run.max_steps),
                  grad_norm=grad_norm, tokens_seen=step * run.config.batch_tokens, tokens_per_s=tokens_per_s, eta_s=eta)
    line = f"step {step}/{run.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e} | {tokens_per_s:,.0f} tok/s"
    if run.peak_flops:
        record["mfu"] = run.flops_per_token * tokens_per_s / (run.peak_flops * run.world)
        line += f" | MFU {100 * record['mfu']:.1f}%"
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


def train(run):
    """The loop: steps, with logs, evaluations and checkpoints at their intervals, until the last
    step, --stop_step or a stop signal. Returns the exit status."""
    config, step, position = run.config, run.start_step, run.start_position
    if step >= run.max_steps:
        print(f"the run is complete ({step} steps); nothing to do")
        return 0
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    timer_start, steps_timed = time.time(), 0
    while step < run.max_steps:
        loss, grad_norm, preempted = train_step(run, step, position)  # preempted: a signal reached some rank
        step, position, steps_timed = step + 1, position + run.step_windows, steps_timed + 1
        stop = preempted or step == config.stop_step
        if run.rank == 0 and (step % config.log_interval == 0 or step == run.max_steps or stop):
            log_step(run, step, loss, grad_norm, time.time() - timer_start, steps_timed)
            timer_start, steps_timed = time.time(), 0
        if (step % config.eval_interval == 0 or step == run.max_steps) and not preempted:  # save first, fast
            result = evaluate(run)
            if run.rank == 0:
                report_eval(result, step, run)
            timer_start, steps_timed = time.time(), 0  # tokens/s counts training only
        if step % config.ckpt_interval == 0 or step == run.max_steps or stop:
            checkpoint(run, step, wait=step == run.max_steps or stop)  # the last one must be on disk
            timer_start, steps_timed = time.time(), 0
        if stop:
            why = signal.Signals(STOP["signal"]).name if STOP["signal"] else f"--stop_step={config.stop_step}"
            if run.rank == 0:
                print(f"stopped at step {step} ({why}); checkpoint saved: continue with the same command plus --resume")
            return 128 + STOP["signal"] if STOP["signal"] else 0
    if run.rank == 0:
        print(f"done: {step} steps, {step * config.batch_tokens:,} tokens; checkpoint {config.out_dir}/ckpt.pt")
    return 0


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
        x, y = to_batch(windows + windows[-1:] * (micro_batch - len(windows)), run.device)
        with run.autocast:
            losses = model(x, y, reduction="none")[:len(windows)]
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


def report_eval(result, step, run):
    print(f"eval step {step}: val loss {result['val_loss']:.4f} | ppl {result['val_ppl']:.2f} | "
          f"{result['val_bpb']:.4f} bits/byte | {result['eval_tokens']:,} tokens")
    print(f"  {'train count':>13} {'tokens':>10} {'loss':>8} {'ppl':>12}")
    for row in result["buckets"]:
        if row["tokens"]:
            print(f"  {row['counts']:>13} {row['tokens']:>10,} {row['loss']:>8.4f} {row['ppl']:>12.2f}")
    record = dict(step=step, tokens_seen=step * run.config.batch_tokens, **result)
    write_json(os.path.join(run.config.out_dir, f"eval_step{step}.json"), record)
    log_record(run, dict(type="eval", **{k: v for k, v in record.items() if k != "buckets"}))


# ---------------------------------------------------------------------------- main: set-up, loop, shut-down


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


def loop(run):
    """Train, or only evaluate with --eval_only; the exit status. A UserError here is raised on every
    rank alike (the loss and the checkpoint's outcome are shared), and rank 0 reports it."""
    try:
        if not run.config.eval_only:
            return train(run)
        result = evaluate(run)
        if run.rank == 0:
            report_eval(result, run.start_step, run)
        return 0
    except UserError as e:
        if run.rank == 0:
            print_error(e)
        return 1
    finally:
        if run.rank == 0:
            run.writer.finish()  # a checkpoint still being written is completed


def main(argv):
    run = set_up(argv)
    return shut_down(1 if run is None else loop(run))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
