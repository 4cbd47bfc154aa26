"""A training run's checkpoint and the events around it: written atomically by rank 0 in the
background while training goes on, read back (onto the CPU, checked), preemption signals that ask
for one, and the agreement of every rank on a failure, so that no rank is left waiting in a collective.
train.py writes and resumes checkpoints; sample.py and evaluate.py load a run's model with
load_model.
"""
import json, os, signal, sys, threading, time
from dataclasses import asdict

import torch
import torch.distributed as dist

from cli import UserError
from data import atomic_write, tokenizer_from_meta
from leviathan import Config, Model

# ---------------------------------------------------------------------------- writing one


def checkpoint(run, step, wait=False):
    """Save the run at this step without stalling training: every rank hands rank 0 its CUDA RNG
    state, rank 0 copies the state to CPU memory (a second or so at 1.2b) and a background thread
    writes it, fsynced and renamed into place (data.atomic_write), while training goes on. One
    write at a time: the next checkpoint, or wait=True (the last step, a preemption), first waits
    for the one in flight. A failed write (a full disk) stops every rank alike, the moment rank 0
    learns of it; the previous checkpoint is kept."""
    rng_cuda = cuda_rng_states(run)
    agree_on_write(run)  # the previous write
    if run.rank == 0:
        run.writer.start(os.path.join(run.config.out_dir, "ckpt.pt"), snapshot(run, step, rng_cuda), step)
    if wait:
        agree_on_write(run)


def snapshot(run, step, rng_cuda):
    """The checkpoint's contents as a copy in CPU memory, so training may change the originals."""
    config = run.config
    state = dict(model=run.raw_model.state_dict(), optimizer=run.optimizer.state_dict(),
                 model_config=asdict(run.model_config), train_config=asdict(config), data_meta=run.meta,
                 step=step, tokens_seen=step * config.batch_tokens, data_position=step * run.step_windows,
                 rng_cpu=torch.get_rng_state(), rng_cuda=rng_cuda)
    return run.writer.copy_to_cpu(state)


def cuda_rng_states(run):
    """Each rank's CUDA RNG state (every GPU draws its own numbers), gathered for rank 0."""
    if run.device.type != "cuda":
        return []
    state = torch.cuda.get_rng_state()
    if run.world == 1:
        return [state]
    states = [None] * run.world
    dist.all_gather_object(states, state)
    return states


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
    """Rank 0's writer thread, and the CPU copy it writes from. On a GPU the copy lands in pinned
    memory, allocated at the first checkpoint and reused: the device-to-host copy then runs at
    full speed, and a 1.2b run holds one ~15 GB copy in host memory."""

    def __init__(self):
        self.thread, self.error, self.buffers = None, None, None

    def copy_to_cpu(self, state):
        """state with every tensor copied into the CPU buffers. Tensors that are one tensor (the tied
        arm's table, which state_dict lists again as the head) get one copy, which torch.save then
        writes once, as it would the originals."""
        tensors = {}  # the distinct tensors, by where their values live
        map_tensors(state, lambda t: tensors.setdefault(memory_of(t), t))
        shapes = [(t.shape, t.dtype) for t in tensors.values()]
        on_gpu = any(t.is_cuda for t in tensors.values())
        if self.buffers is None or [(b.shape, b.dtype) for b in self.buffers] != shapes:
            self.buffers = [torch.empty(shape, dtype=dtype, pin_memory=on_gpu) for shape, dtype in shapes]
        copies = dict(zip(tensors, self.buffers))
        for key, t in tensors.items():
            copies[key].copy_(t, non_blocking=True)
        if on_gpu:
            torch.cuda.synchronize()  # the copies are complete before training changes the originals
        return map_tensors(state, lambda t: copies[memory_of(t)])

    def start(self, path, state, step):
        self.thread = threading.Thread(target=self.write, args=(path, state, step))
        self.thread.start()

    def write(self, path, state, step):
        start = time.time()
        try:
            atomic_write(path, lambda f: torch.save(state, f))
        except OSError as e:  # e.g. no space left
            self.error = UserError(f"could not write {path} ({e.strerror or e}); the previous checkpoint is kept")
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


# ---------------------------------------------------------------------------- reading one


def load_checkpoint(path, keys=("model", "model_config", "data_meta")):
    """A train.py checkpoint, checked to hold `keys`. Always onto the CPU, whatever device saved
    it: RNG states must be CPU tensors, and each rank copies only the weights into its own GPU.
    Memory-mapped: only the tensors used are read, and ranks on one node share one copy."""
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


def keep_log_until(path, step):
    """On resume, drop log lines past the checkpoint (an interrupted run may have logged beyond it)."""
    if os.path.exists(path):  # a run killed mid-write leaves a partial last line: dropped too
        lines = [line for line in open(path) if line.endswith("\n") and json.loads(line)["step"] <= step]
        atomic_write(path, lambda f: f.writelines(lines), mode="w")


def load_model(out_dir, device="cpu"):
    """A run's model in eval mode, the tokenizer of its data, and its step. For inference, call
    model.freeze_lev() once every other check has passed (slow for a large vocabulary on a CPU)."""
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


# ---------------------------------------------------------------------------- preemption and failures


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

