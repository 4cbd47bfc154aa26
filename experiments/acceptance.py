"""The GPU acceptance run: whether the CUDA path does what the README says, on one GPU, in at most 8 minutes.

    python -m experiments.bench gpu         # PASS (exit 0), FAIL (1: a figure is wrong) or INCOMPLETE (2: a
                                            # figure not measured in time); every figure in bench_gpu.json
    python -m experiments.bench gpu --toy   # every check on a CPU, a micro model in place of 200m and 1.2b

It runs train.py as a user does (torch.compile, bf16 autocast, fused AdamW, each size's micro-batch of
16 x 512) on the demo corpus with the full o200k vocabulary, and holds the GPU to references computed in
float32/float64 on the GPU itself. The order puts what must be timed alone first and the 1.2b save off
the critical path:
  references  LEV's fast path (4,096 ids) and the chunked loss against their plain forms.
  1.2b        started at once, 2 micro-batches a step; stopped (no save) once it has logged LARGE_STEPS
              steps: memory, MFU, graphs. While it compiles (CPU work), this process measures the disk
              (a 2 GB write + fsync: what the 14.7 GB save would cost) and one 200m micro-batch pair
              compiled under bf16 against the eager float32 model (grad_reference, sdpa_kernel).
  200m        4 micro-batches a step, --deterministic, side by side: a run of STEPS steps that also
              evaluates; one sent SIGTERM after SIGNAL_AFTER steps, then resumed with a fresh compile
              cache and stopped (no save) at step STEPS; 2 ranks sharing the GPU (gloo, --bf16_allreduce);
              with 2+ GPUs, 2 ranks on NCCL.
  LEV alone   a 1.2b micro-batch of Zipf ids, timed alone: LEV's share of a micro-step.
Estimated on one H100/H200 with a slow disk (no GPU run has confirmed it; the last lines printed give
the measured time): data 10 s; references 30 s; 1.2b: start 20 s + compile 120 s + steps 5 s = 145 s;
200m, on the critical path: the signalled run's start, cold compile and 2.5 GB save, 115 s, then the
resumed run's start and cold compile, 105 s (the others alongside); LEV alone 40 s: ~445 s in all.
BUDGET_S bounds the whole: past it every run is stopped, every figure logged so far is kept, and what
was not measured makes the verdict INCOMPLETE, never FAIL. SIGTERM or Ctrl-C does the same at once.
"""
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from experiments import runs
from experiments.bench import MEMORY_ESTIMATE_GB, PREPARE_DATA, parameter_count, size_model
from leviathan import (LEV, Config, Fused, Model, compile_lev, linear_cross_entropy, padded_vocab,
                       precision)
from prepare_data import UserError, load_meta, write_json
from train import Windows, accumulate_gradients, open_data, peak_flops, resolve

BUDGET_S = 8 * 60  # the whole run, verdict included (a lent GPU comes with ~15 minutes, start-up included)
CLOSING_S = 20  # of it, kept to stop the runs, read their logs, delete their folder and give the verdict
STEPS = 10  # of the 200m runs
SIGNAL_AFTER = 2  # the stopped 200m run gets SIGTERM once it has logged this many steps
LARGE_STEPS = 8  # of the 1.2b run: its speed is the median of the steps after the first two
EAGER_WARNING = "runs eagerly (slower)"  # LEV's or the loss's kernels: Fused
# LEV's cost grows with the distinct ids of a micro-batch: ids drawn with P(rank r) ~ r^-1 (Zipf), the ranks
# shuffled over the ids, give ~3,900 distinct o200k ids in 16 x 512 tokens, the top of The Pile's ~2,000-4,000.
ZIPF_EXPONENT = 1.0
# --toy: both sizes become this micro model, trained on --data_dir (a CPU runs every check in minutes)
TOY = dict(size="tiny", d_model=32, n_layer=1, n_head=2, seq_len=32, micro_batch=8, lev_seed_dim=16, lev_heads=2,
           lev_knots=4, lev_rank=8)

# Each check's limit, and why; a check fails above its limit (below it for FLOORS), and is INCOMPLETE while
# its figure is not measured.
LIMITS = {
    # LEV's fast path (fused kernels, float32) against generate_reference in float64 at the 1.2b LEV, 4,096
    # distinct ids: on a GPU 2 chunks forward and 4 backward (seed_chunks). The largest error of E and of every
    # gradient, relative to that tensor's largest entry. Float32 rounding of a 128-factor product gives ~1e-6;
    # a wrong index, slope or chunk boundary gives O(1).
    "lev_reference": 1e-4,
    # The chunked loss under bf16 autocast against F.cross_entropy on the whole logits under the same autocast,
    # at the 1.2b head: both round the softmax's gradient to bf16 for the matmuls (~4e-3); a lost chunk, O(1).
    "loss_reference": 2e-2,
    # One 200m micro-batch pair (accum = 2) through train.py's accumulate_gradients, compiled under bf16
    # autocast, against the eager float32 model on the same tokens, its head random (a zero head would leave
    # the backbone without gradient): the worst parameter's |g - g_ref| / |g_ref| (whole tensors). bf16 keeps
    # 8 bits: each matmul's output is off by ~2e-3 relative, and the ~2 n_layer + 2 matmuls each way compound
    # that to ~5e-3-1e-2 (5.5e-3 measured on a CPU: experiments/README.md). It bounds the gradient norms'
    # ratio too. A lost 1/accum doubles every gradient (error 1); a micro-step counted twice moves them ~50%.
    "grad_reference": 2e-2,
    # The first logged loss of the 200m lev run against ln V: its head starts at zero, so every logit is 0.
    "first_loss": 1e-3,
    # That run's loss at step STEPS over its first: a model that learns falls well below 0.9.
    "loss_falls": 0.9,
    # Its evaluation at step STEPS (the compiled no-grad graph): finite and below ln V (set per run).
    "eval": None,
    # The run stopped by SIGTERM and resumed, with a compile cache of its own, against the uninterrupted
    # run: the largest |loss difference| over STEPS steps. --deterministic promises bit-identical losses.
    "resume_cold_cache": 0.0,
    # The SIGTERM run: steps between the last it trained and the one it saved, plus steps between that and
    # the first its --resume trains; it must also exit 128 + SIGTERM (its run line).
    "signal_stop": 0,
    # 2 ranks sharing the GPU (gloo) with --bf16_allreduce against one rank, the same batches: the largest
    # |loss difference|. bf16 rounds the summed gradients by <= 2^-9; AdamW's update moves by as much, at
    # most ~2^-9 of the ~3 nats the loss falls in STEPS steps if every rounding lined up: 6e-3, bounded by
    # 1e-2. A rank's gradient left out, or a micro-step counted twice, changes a quarter of the batch.
    "ddp_one_gpu": 1e-2,
    # 2 GPUs on NCCL in float32 against one: only the summation order differs.
    "ddp": 1e-3,
    # Outputs holding EAGER_WARNING: on a GPU, LEV's and the loss's kernels must compile.
    "eager": 0,
    # The worst of the memory figures over the runs, as a fraction of its limit: allocated within the README's
    # estimate + 10% (allocator rounding), reserved within + 20% (fragmentation as well).
    "memory": 1.0,
    # Attention calls that ran the math fallback in a profiled compiled bf16 micro-step, plus 1 if none ran
    # a flash or cuDNN kernel: the fallback writes [T, T] scores and is several times slower.
    "sdpa_kernel": 0,
    # The 1.2b run's median model FLOPs utilisation (a floor): dense bf16 matmuls of this size reach 35-50%
    # of an H100's peak; 20% leaves room for LEV and the loss, and catches eager runs or a sync per kernel.
    "mfu 1.2b": 0.20,
    # Graph breaks TorchDynamo met in the 1.2b run: LEV.forward and the product stay out of the graphs on
    # purpose (leviathan.py, "What torch.compile sees"), a handful; one per block would be 16 or more.
    "graph_breaks 1.2b": 10,
    # Graphs compiled after its second step, when every shape has been met: a guard failed by a new id
    # bucket may cost one or two; a graph per step means the shapes are not bounded.
    "recompiles 1.2b": 2,
    # LEV's forward + backward for a 1.2b micro-batch of Zipf ids over a whole 1.2b micro-step: ~62 TFLOP
    # of bf16 matmuls against ~0.03 TFLOP of LEV, ~1-3% expected; 5% catches LEV off its fast path (phi
    # written to memory, eager kernels, a wait per chunk). The paper's first version cost 23-51%.
    "lev_share": 0.05,
}
FLOORS = {"mfu 1.2b"}
MEMORY_HEADROOM = {"peak_mem_gb": 0.10, "peak_reserved_gb": 0.20}  # allocated, reserved

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGALRM)  # SIGALRM: BUDGET_S - CLOSING_S has passed
STOP = {"by": None}  # what stopped the measuring: the first of STOPS to arrive

class Stopped(BaseException):
    """Raised where the measuring is when one of STOPS arrives (a BaseException, as KeyboardInterrupt is: the
    compiler wraps or falls back on an Exception), and again at its next wait should the code it interrupted
    have caught it anyway."""

def stop_measuring(signum, frame):
    if STOP["by"] is None:  # one is enough: a second must not cut the verdict short
        STOP["by"] = "the time budget" if signum == signal.SIGALRM else signal.Signals(signum).name
        raise Stopped(STOP["by"])

def check_time(deadline):
    """Raise Stopped if one of STOPS has arrived, or the deadline has passed."""
    if STOP["by"] is None and time.time() >= deadline:
        STOP["by"] = "the time budget"
    if STOP["by"] is not None:
        raise Stopped(STOP["by"])

# ---------------------------------------------------------------------------- the run, start to verdict

def acceptance(args, device):
    """Measure until done, out of time or stopped; then, whatever happened, every figure logged, the verdict,
    the JSON. Returns the exit status: 0 PASS, 1 FAIL, 2 INCOMPLETE."""
    start, cuda = time.time(), device.type == "cuda"
    figures = dict(device=torch.cuda.get_device_name() if cuda else "cpu", gpus=torch.cuda.device_count() if cuda
                   else 1, torch=torch.__version__, toy=args.toy, runs={}, checks={}, limits={}, skipped={},
                   seconds={}, speed={}, disk=None, lev=None, grad_norm_ratio=None, ended="done", crash=None)
    due_checks(figures, args, cuda)
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"\nGPU acceptance run: {figures['gpus']} x {figures['device']}, torch {torch.__version__}; runs in "
          f"{args.out_dir} (deleted at the end); at most {BUDGET_S // 60} min", flush=True)
    started, STOP["by"] = {}, None  # started: name: (process, start time); stopped and read whatever happens
    previous = {stop: signal.signal(stop, stop_measuring) for stop in STOPS}
    signal.setitimer(signal.ITIMER_REAL, BUDGET_S - CLOSING_S)
    try:
        measure(args, device, figures, started, start + BUDGET_S - CLOSING_S)
        check_time(math.inf)  # a stop the measuring caught and carried on past is still one
    except Stopped:
        figures["ended"] = f"stopped by {STOP['by']} after {time.time() - start:.0f} s"
    except Exception as error:  # noqa: BLE001  the GPU path itself failed here (a kernel, memory): a FAIL
        figures["crash"] = traceback.format_exc().splitlines()[-40:]
        figures["ended"] = f"crashed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for stop in STOPS:
            signal.signal(stop, signal.SIG_IGN)
        for name, (process, _) in started.items():
            if process.poll() is None:
                runs.stop(process, signal.SIGKILL)
                figures["runs"][name].setdefault("stopped", f"cut short: {figures['ended']}")
            figures["runs"][name]["exit"] = process.returncode
        read_runs(args.out_dir, figures)
        shutil.rmtree(args.out_dir, ignore_errors=True)
        figures["wall_s"] = round(time.time() - start, 1)
        figures["lines"] = check_lines(figures)
        write_json(args.json, figures)
        for stop, handler in previous.items():
            signal.signal(stop, handler)
    return report(figures, args.json)

def due_checks(figures, args, cuda):
    """Every check this machine can make, entered as not measured (None) with its limit; the others skipped."""
    skipped = {"ddp": "one GPU (its 2-GPU form needs 2)"} if figures["gpus"] < 2 else {}
    if not cuda:
        skipped.update({"memory": "no CUDA allocator on a CPU", "mfu 1.2b": "no peak FLOP/s for a CPU",
                        "graph_breaks 1.2b": "the runs are not compiled on a CPU",
                        "recompiles 1.2b": "the runs are not compiled on a CPU",
                        "lev_share": "a GPU's proportion: a CPU weighs LEV's kernels and the matmuls otherwise"})
    for check, limit in LIMITS.items():
        if check not in skipped:
            figures["checks"][check] = None
            figures["limits"][check] = limit  # eval's, ln V, once the data is there
    figures["skipped"] = skipped

def measure(args, device, figures, started, deadline):
    """The parts in the module docstring's order; each figure enters figures as soon as it is measured."""
    checks, cuda = figures["checks"], device.type == "cuda"
    small, large = shape_of("200m", args.toy), shape_of("1.2b", args.toy)
    part = timed_parts(figures["seconds"], deadline)
    with part("data"):
        prepare_o200k_demo(args.data_dir)
        figures["limits"]["eval"] = math.log(shape_config(args.data_dir, small).vocab_size)
    with part("references"):
        checks["lev_reference"] = lev_reference_error(args.data_dir, device, large)
        checks["loss_reference"] = loss_reference_error(args.data_dir, device, large)
        if cuda:
            torch.cuda.empty_cache()  # what the references held, back to the GPU for the runs
    with part("1.2b run"):
        start_run("1.2b", options(args, device, large, "1.2b", 2), args, figures, started)
        figures["disk"] = disk_speed(args.out_dir, (64 << 20) if args.toy else (2 << 30), large, args.data_dir)
        checks["grad_reference"], figures["grad_norm_ratio"], checks["sdpa_kernel"] = grad_reference(
            args.data_dir, device, small)
        if cuda:
            torch.cuda.empty_cache()
        stop_once_logged("1.2b", LARGE_STEPS, args, figures, started, deadline)  # not its save (~15 GB, 1+ min)
    with part("200m runs"):
        run_200m(args, device, small, figures, started, deadline)
    with part("LEV alone"):
        figures["lev"] = lev_figures(args.data_dir, device, large)

def run_200m(args, device, shape, figures, started, deadline):
    """The 200m runs side by side; the stopped one resumed as soon as it has saved."""
    exact = ["--deterministic", f"--stop_step={STEPS}"]
    start_run("200m-whole", options(args, device, shape, "200m-whole", 4, *exact, f"--eval_interval={STEPS}"),
              args, figures, started)
    start_run("200m-stopped", options(args, device, shape, "200m-resumed", 4, *exact), args, figures, started,
              expected=128 + signal.SIGTERM)
    one_gpu = ["--backend=gloo"] + (["--bf16_allreduce"] if device.type == "cuda" else [])
    start_run("200m-ddp-one-gpu", options(args, device, shape, "200m-ddp-one-gpu", 4, *exact, *one_gpu), args,
              figures, started, processes=2, env={"CUDA_VISIBLE_DEVICES": "0"} if device.type == "cuda" else None)
    if "ddp" in figures["checks"]:
        start_run("200m-ddp", options(args, device, shape, "200m-ddp", 4, *exact), args, figures, started,
                  processes=2)
    wait_for_step(args.out_dir, "200m-resumed", SIGNAL_AFTER, started, deadline, name="200m-stopped")
    process = started["200m-stopped"][0]
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # its own session: train.py alone gets it
    wait_for_run("200m-stopped", figures, started, deadline)
    if process.returncode == 128 + signal.SIGTERM:  # its own compile cache: a cold start must sum alike
        cold = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(os.path.join(args.out_dir, "compile-cache-resumed"))}
        start_run("200m-resumed", options(args, device, shape, "200m-resumed", 4, "--deterministic", "--resume"),
                  args, figures, started, env=cold)
        stop_once_logged("200m-resumed", STEPS, args, figures, started, deadline)  # its save is not needed
    for name in list(started):
        wait_for_run(name, figures, started, deadline)

# ---------------------------------------------------------------------------- train.py runs

def shape_of(size, toy):
    """train.py's options for a size's model: the preset, or TOY."""
    return TOY if toy else {"size": size}

def micro_batch_shape(shape):
    """(sequences, tokens per sequence) of one micro-batch of a shape."""
    preset = resolve({"size": shape["size"]})
    return shape.get("micro_batch", preset.micro_batch), shape.get("seq_len", preset.seq_len)

def options(args, device, shape, folder, micro_batches, *more):
    """train.py's options: the shape, micro_batches micro-batches a step of a 1000-step schedule (2 steps of
    warmup), a log line every step, no evaluation or checkpoint unless asked for."""
    micro_tokens = math.prod(micro_batch_shape(shape))
    return [*(f"--{key}={value}" for key, value in shape.items()), f"--data_dir={args.data_dir}",
            f"--out_dir={os.path.join(args.out_dir, folder)}", f"--device={device.type}",
            f"--batch_tokens={micro_batches * micro_tokens}", f"--total_tokens={1000 * micro_batches * micro_tokens}",
            "--warmup_steps=2", "--log_interval=1", f"--eval_tokens={micro_tokens}", "--eval_interval=1000",
            "--ckpt_interval=1000", *more]

def start_run(name, train_options, args, figures, started, expected=0, processes=1, env=None):
    """train.py in its own session (its output in out_dir/<name>.txt), compiling into a cache of this run's
    (cold, as on a new machine: a rerun measures the same) unless env says otherwise; expected: the exit
    status it should end with (128 + SIGTERM for the run that gets one)."""
    output, cache = os.path.join(args.out_dir, f"{name}.txt"), os.path.join(args.out_dir, "compile-cache")
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.abspath(cache), **(env or {})}
    started[name] = runs.start(train_options, processes, output, env=env), time.time()
    figures["runs"][name] = dict(expected=expected, output=output)
    print(f"started {name}", flush=True)

def wait_for_step(out_dir, folder, step, started, deadline, name=None):
    """Until the run in folder has logged step, ended, or the deadline has passed."""
    process = started[name or folder][0]
    while process.poll() is None:
        check_time(deadline)
        records = runs.log_records(os.path.join(out_dir, folder), "train")
        if records and records[-1]["step"] >= step:
            return
        time.sleep(0.01)

def stop_once_logged(name, step, args, figures, started, deadline):
    """Wait until the run (in the folder of its name) has logged step, then stop it where it is (SIGKILL)."""
    wait_for_step(args.out_dir, name, step, started, deadline)
    if started[name][0].poll() is None:
        runs.stop(started[name][0], signal.SIGKILL)
        figures["runs"][name]["stopped"] = f"by this run, once it had logged {step} steps"

def wait_for_run(name, figures, started, deadline):
    """Until the run ends (a run that hangs, in a collective say, meets the deadline); its seconds."""
    process, start = started[name]
    while process.poll() is None:
        check_time(deadline)
        time.sleep(0.05)
    figures["runs"][name]["seconds"] = round(time.time() - start, 1)
    print(f"  {name}: exit status {process.returncode} after {time.time() - start:.0f} s", flush=True)

# ---------------------------------------------------------------------------- what the runs logged

def read_runs(out_dir, figures):
    """Every figure the runs' logs and outputs hold, whether or not they ended (a run stopped by the budget
    keeps what it logged). A run that failed keeps its last 40 lines."""
    train = {folder: runs.log_records(os.path.join(out_dir, folder), "train") for folder in
             ("200m-whole", "200m-resumed", "200m-ddp-one-gpu", "200m-ddp", "1.2b")}
    checks, outputs = figures["checks"], {}
    for name, run in figures["runs"].items():
        outputs[name] = open(run["output"]).read() if os.path.exists(run["output"]) else ""
        if run_line(name, run)[0] != "ok":
            run["tail"] = outputs[name].splitlines()[-40:]
    for name in ("200m-whole", "1.2b"):  # the runs the memory check reads (one process each)
        run = figures["runs"].get(name, {})
        run.update({key: max((r[key] for r in train[name] if key in r), default=None) for key in MEMORY_HEADROOM})
    for check, folder in (("resume_cold_cache", "200m-resumed"), ("ddp_one_gpu", "200m-ddp-one-gpu"),
                          ("ddp", "200m-ddp")):
        if check in checks:  # measured once both runs have logged every step
            checks[check] = largest_loss_difference(train["200m-whole"], train[folder], STEPS)
    if train["200m-whole"] and figures["limits"]["eval"]:
        first, last = train["200m-whole"][0], train["200m-whole"][-1]
        checks["first_loss"] = abs(first["loss"] - figures["limits"]["eval"]) if first["step"] == 1 else None
        checks["loss_falls"] = last["loss"] / first["loss"] if last["step"] == STEPS else None
    checks["eval"] = next((r["val_loss"] for r in runs.log_records(os.path.join(out_dir, "200m-whole"), "eval")),
                          None)
    saved = saved_step(outputs.get("200m-stopped", ""))
    checks["signal_stop"] = steps_lost(outputs.get("200m-stopped", ""), saved, outputs.get("200m-resumed", ""))
    if "memory" in checks:
        checks["memory"] = memory_fraction({"200m": train["200m-whole"], "1.2b": train["1.2b"]})
    resumed = [r for r in train["200m-resumed"] if saved is not None and r["step"] > saved]
    for name, folder, steps, micro_batches in (("200m", "200m-resumed", resumed, 4),
                                               ("1.2b", "1.2b", train["1.2b"], 2)):
        figures["speed"][name] = speed(steps, micro_batches, os.path.join(out_dir, folder), figures["device"])
    if "mfu 1.2b" in checks and figures["speed"]["1.2b"]:
        checks["mfu 1.2b"] = figures["speed"]["1.2b"]["mfu"]
    compiled = [r for r in train["1.2b"] if "graphs" in r]
    if "graph_breaks 1.2b" in checks and len(compiled) >= 2:
        checks["graph_breaks 1.2b"] = compiled[-1]["graph_breaks"]
        checks["recompiles 1.2b"] = compiled[-1]["graphs"] - compiled[1]["graphs"]
    if "lev_share" in checks and figures["lev"] and figures["speed"]["1.2b"]:
        checks["lev_share"] = figures["lev"]["seconds"] / figures["speed"]["1.2b"]["micro_step_s"]
    if outputs:  # the runs' outputs, and this process's own kernels
        checks["eager"] = sum(EAGER_WARNING in output for output in outputs.values()) + len(Fused.warned)

def run_line(name, run):
    """(state, line) for a run: ok when it ended as expected, or was stopped here once measured; INCOMPLETE
    when cut short by the end of this run (the budget, a signal, a crash here); FAIL otherwise."""
    stopped, code = run.get("stopped", ""), run.get("exit")
    line = f"run {name}: exit status {code}" + (f" ({stopped})" if stopped else "") + f" vs {run['expected']}"
    if stopped.startswith("by this run") or code == run["expected"] and not stopped:
        return "ok", line
    return ("INCOMPLETE" if stopped.startswith("cut short") else "FAIL"), line

def largest_loss_difference(a, b, steps):
    """The largest |loss difference| of two runs' records over steps 1..steps; None unless both logged them."""
    losses = [{r["step"]: r["loss"] for r in records} for records in (a, b)]
    if any(step not in run for run in losses for step in range(1, steps + 1)):
        return None
    return max(abs(losses[0][step] - losses[1][step]) for step in range(1, steps + 1))

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

def memory_fraction(logs):
    """The worst peak (allocated, reserved) of the runs as a fraction of its limit (MEMORY_HEADROOM)."""
    fractions = [max(r[key] for r in records) / (MEMORY_ESTIMATE_GB[size][0] * (1 + headroom))
                 for size, records in logs.items() if records for key, headroom in MEMORY_HEADROOM.items()]
    return max(fractions, default=None)

def speed(records, micro_batches, run_dir, device_name):
    """Median tokens/s and MFU (Model.flops_per_token x tokens/s over one GPU's peak) of one process's steps but
    its first two (compilation, first allocations), and the time of one micro-step; None if there are none."""
    steady = records[2:]
    if not steady:
        return None
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    batch_tokens = steady[0]["tokens_seen"] // steady[0]["step"]
    with torch.device("meta"):
        flops = Model(Config(**json.load(open(os.path.join(run_dir, "config.json")))["model"])).flops_per_token()
    peak = peak_flops(device_name)
    return dict(tokens_per_s=tokens_per_s, mfu=flops * tokens_per_s / peak if peak else None,
                micro_step_s=batch_tokens / tokens_per_s / micro_batches, steps=len(steady))

# ---------------------------------------------------------------------------- measured in this process

def shape_config(data_dir, shape):
    """The lev model of a shape (a size, or TOY) at the data's vocabulary."""
    vocab_size = load_meta(data_dir)["vocab_size"]
    model_fields = {f.name for f in dataclasses.fields(Config)}
    return size_model(shape["size"], vocab_size=padded_vocab(vocab_size),
                      **{key: value for key, value in shape.items() if key in model_fields})

def relative_error(got, want):
    """The largest |got - want|, relative to want's largest entry."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()

def zipf_ids(vocab_size, shape, exponent, seed=0):
    """Token ids drawn with P(rank r) ~ r^-exponent, the ranks shuffled over the ids."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab_size + 1, dtype=torch.float64) ** -exponent
    ranks = torch.multinomial(weights, math.prod(shape), replacement=True, generator=generator)
    return torch.randperm(vocab_size, generator=generator)[ranks].view(shape)

def lev_reference_error(data_dir, device, shape):
    """LEV's fast path against generate_reference in float64 (LIMITS): the largest relative error of E and
    of every parameter's gradient, for 4,096 distinct ids."""
    cfg = shape_config(data_dir, shape)
    ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:4096].sort().values
    torch.manual_seed(0)
    lev = LEV.from_config(cfg).to(device)
    reference = LEV.from_config(cfg).to(device, torch.float64)
    reference.load_state_dict(lev.state_dict())
    ids = ids.to(device)
    probe = torch.randn(len(ids), cfg.d_model, device=device, dtype=torch.float64)  # dL/dE, the same for both
    fast, exact = lev.generate(ids), reference.generate_reference(ids)
    (fast * probe.float()).sum().backward()
    (exact * probe).sum().backward()
    return max([relative_error(fast, exact)] + [relative_error(p.grad, q.grad) for p, q in
                                                zip(lev.parameters(), reference.parameters())])

def loss_reference_error(data_dir, device, shape):
    """The chunked loss against F.cross_entropy on the whole logits, both under bf16 autocast (LIMITS): the
    largest relative error of the loss, dL/dx and dL/dW, for one micro-batch at the shape's head."""
    cfg = shape_config(data_dir, shape)
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
    return max(relative_error(got, want) for got, want in zip(*results))

def grad_reference(data_dir, device, shape):
    """(worst relative gradient error, gradient norm ratio, sdpa_kernel's figure) of two micro-batches of real
    text through train.py's accumulate_gradients, the model compiled under bf16 autocast, against the eager
    float32 model on both at once (LIMITS). The second, compiled pass is profiled for its attention kernels."""
    cfg, (micro_batch, seq_len) = shape_config(data_dir, shape), micro_batch_shape(shape)
    meta, splits, *_ = open_data(data_dir)
    train_windows = Windows(splits["train"], seq_len, 0, meta["vocab_size"])
    windows = [train_windows[p] for p in range(2 * micro_batch)]
    torch.manual_seed(0)
    reference = Model(cfg).to(device)
    torch.nn.init.normal_(reference.head.weight, std=0.02)  # a zero head gives the backbone no gradient
    fast = copy.deepcopy(reference)
    fast.compile()
    run = SimpleNamespace(model=fast, config=SimpleNamespace(micro_batch=micro_batch), accum=2, rank=0, world=1,
                          device=device, lev=True, autocast=precision(device, bf16=True))
    accumulate_gradients(run, windows)  # compiles
    fast.zero_grad(set_to_none=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                           if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        accumulate_gradients(run, windows)
    xy = torch.from_numpy(np.stack(windows).astype(np.int64)).to(device)
    reference(xy[:, :-1], xy[:, 1:]).backward()
    pairs = [(p.grad, q.grad) for p, q in zip(fast.parameters(), reference.parameters())]
    worst = max(((g - r).norm() / r.norm()).item() for g, r in pairs)
    ratio = (torch.stack([g.norm() for g, _ in pairs]).norm() / torch.stack([r.norm() for _, r in pairs]).norm())
    names = [event.key for event in profile.key_averages()]
    fallbacks = sum(bool(re.search(r"scaled_dot_product_attention_math", n)) for n in names)
    fast_kernels = any(re.search(r"flash|cudnn", n, re.I) for n in names)
    return worst, ratio.item(), fallbacks + (0 if fast_kernels else 1)

def lev_figures(data_dir, device, shape):
    """LEV's forward and backward for one micro-batch of the shape, of Zipf ids over the data's vocabulary,
    as the model runs it: compiled on CUDA, under bf16 autocast (which LEV turns off inside). The median of
    10 calls after 3 (compilation, warm-up)."""
    ids = zipf_ids(load_meta(data_dir)["vocab_size"], micro_batch_shape(shape), ZIPF_EXPONENT).to(device)
    torch.manual_seed(0)
    lev = LEV.from_config(shape_config(data_dir, shape)).to(device)
    if device.type == "cuda":
        compile_lev(lev)
    times = []
    for _ in range(13):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            embeddings = lev(ids)
        embeddings.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return dict(zipf_exponent=ZIPF_EXPONENT, tokens=ids.numel(), distinct_ids=ids.unique().numel(),
                seconds=statistics.median(times[3:]))

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
    checkpoint_gb = 12 * parameter_count(shape_config(data_dir, shape)) / 1e9
    return dict(gb_per_s=gb_per_s, checkpoint_gb=checkpoint_gb, checkpoint_s=checkpoint_gb / gb_per_s)

def prepare_o200k_demo(data_dir):
    """The demo corpus with the full o200k vocabulary (offline), prepared the first time only (and again where
    an older prepare_data.py left a file out: the rerun adds it)."""
    if all(os.path.exists(os.path.join(data_dir, name)) for name in ("meta.json", "token_bytes.npy")):
        return
    print(f"preparing {data_dir}: the demo corpus with the full o200k vocabulary", flush=True)
    result = subprocess.run([sys.executable, PREPARE_DATA, "--dataset=demo", "--vocab_size=0",
                             f"--out_dir={data_dir}"], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"prepare_data.py could not prepare {data_dir}: "
                        + (result.stderr.strip().splitlines() or ["no message"])[-1])

def timed_parts(seconds, deadline):
    """part(name): a context that enters the seconds its block took in seconds[name] and prints them; none
    starts past the deadline."""
    @contextlib.contextmanager
    def part(name):
        check_time(deadline)
        start = time.time()
        try:
            yield
        finally:
            seconds[name] = round(time.time() - start, 1)
            print(f"  {name}: {seconds[name]:.0f} s", flush=True)
    return part

# ---------------------------------------------------------------------------- the verdict

def shown(check, value):
    """A check's figure or limit as printed."""
    if value is None:
        return "not measured"
    return f"{value:.1%}" if check in ("lev_share", "mfu 1.2b", "memory") else f"{value:.3g}"

def check_lines(figures):
    """Every check as [state, line]: ok, FAIL or INCOMPLETE (not measured), each run's first. A function of
    the figures alone."""
    lines = [list(run_line(name, run)) for name, run in figures["runs"].items()]
    if figures.get("crash"):
        lines.append(["FAIL", f"this process {figures['ended']}"])
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
    print(f"\n{'run':<18}{'tokens/s':>10}{'MFU':>7}{'peak GB: allocated':>20}{'reserved':>10}")
    for name, run in figures["runs"].items():
        size = "1.2b" if name == "1.2b" else "200m" if name == "200m-resumed" else None
        speed_ = figures["speed"].get(size) or {}
        print(f"{name:<18}{cell(speed_.get('tokens_per_s'), ',.0f'):>10}{cell(speed_.get('mfu'), '.1%'):>7}"
              f"{cell(run.get('peak_mem_gb'), '.1f'):>20}{cell(run.get('peak_reserved_gb'), '.1f'):>10}")
    if figures["disk"]:
        disk = figures["disk"]
        print(f"disk: {disk['gb_per_s']:.2f} GB/s written and synced; a 1.2b checkpoint ({disk['checkpoint_gb']:.1f}"
              f" GB) would take {disk['checkpoint_s']:.0f} s")
    if figures["grad_norm_ratio"] is not None:
        print(f"gradient norm, compiled bf16 over eager float32: {figures['grad_norm_ratio']:.4f}")
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
    print(f"wall time {minutes} min {seconds:02d} s ({parts}); {figures['ended']}; every figure in {json_path}")
    result, total = verdict(figures["lines"]), len(figures["lines"])
    counts = {state: sum(s == state for s, _ in figures["lines"]) for state in ("FAIL", "INCOMPLETE")}
    print(f"{result}: all {total} checks" if result == "PASS" else f"{result}: " + ", ".join(
        f"{n} {state.lower()}" for state, n in counts.items() if n) + f" of {total} checks")
    return {"PASS": 0, "FAIL": 1, "INCOMPLETE": 2}[result]

def cell(value, spec):
    return "-" if value is None else format(value, spec)
