"""Benchmarks that print figures, and the GPU acceptance test.

    python -m experiments.bench          # every section but gpu
    python -m experiments.bench model    # lev vs tied vs untied step time and peak memory
    python -m experiments.bench model --compile
    python -m experiments.bench memory   # the README's memory table: what the compiled graph saves, at each paper size
    python -m experiments.bench gpu      # the acceptance test on a CUDA GPU: PASS or FAIL, exit status 1 on FAIL

Ratios are what to compare: each is measured within one run, the arms interleaved
step by step so that a machine slowing down affects all of them alike. No test depends
on the figures (timings vary by machine); `gpu` checks its own against thresholds.
"""
import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

from experiments import runs
from leviathan import (EMBEDDINGS, LEV, LOSS_CHUNK_LOGITS, Config, Fused, Model, compile_lev, generate,
                       linear_cross_entropy, padded_vocab)
from prepare_data import (ArgumentParser, UserError, demo_documents, get_tokenizer, load_meta, parse_number, run_main,
                          write_json)
from train import DATA, model_config, resolve

PREPARE_DATA = os.path.join(runs.ROOT, "prepare_data.py")


def size_model(size, **overrides):
    """The model of a size in train.SIZES, on its own data's vocabulary, with some fields changed."""
    config = resolve({"size": size})
    return dataclasses.replace(model_config(config, DATA[config.data_dir][1]), **overrides)


def real_token_batch(tokenizer, batch, seq_len):
    """Token ids of real text (the demo corpus), so the number of distinct ids per batch,
    which is what LEV's cost depends on, is realistic (random ids would inflate it)."""
    ids = []
    for doc in demo_documents():
        ids += tokenizer.encode(doc) + [tokenizer.eot]
        if len(ids) > batch * (seq_len + 1):
            break
    return torch.tensor(ids[:batch * (seq_len + 1)]).view(batch, seq_len + 1)


class PeakMemory:
    """Peak memory of a block above its starting point. CUDA: the allocator's own
    counter. CPU: the process RSS sampled every millisecond from a thread (torch ops
    release the GIL), an estimate good to a few MB."""

    def __init__(self, device):
        self.device, self.peak = device, 0

    def _rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, self._rss() - self._start)
            time.sleep(0.001)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        else:
            self._start, self._done = self._rss(), threading.Event()
            self._thread = threading.Thread(target=self._sample)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._start
        else:
            self._done.set()
            self._thread.join()


def train_step(model, optimizer, batch, device):
    x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_arms(title, cfg, batch, device, compile_model, repeats):
    """Step time (median) and peak memory of the three arms on identical backbones."""
    models, optimizers = {}, {}
    for embedding in EMBEDDINGS:
        torch.manual_seed(0)
        model = Model(Config(**{**cfg.__dict__, "embedding": embedding})).to(device)
        optimizers[embedding] = model.configure_optimizers(lr=1e-4, weight_decay=0.1,
                                                           fused=device.type == "cuda")
        if compile_model:
            model.compile()
        models[embedding] = model
        train_step(model, optimizers[embedding], batch, device)  # warm-up (and compile)
    times, peaks = {e: [] for e in EMBEDDINGS}, {}
    for _, embedding in itertools.product(range(repeats), EMBEDDINGS):  # interleaved
        start = time.perf_counter()
        train_step(models[embedding], optimizers[embedding], batch, device)
        times[embedding].append(time.perf_counter() - start)
    for embedding in EMBEDDINGS:  # a step of its own: the CPU sampler thread would slow the timed ones
        with PeakMemory(device) as memory:
            train_step(models[embedding], optimizers[embedding], batch, device)
        peaks[embedding] = memory.peak
    tokens = batch.shape[0] * (batch.shape[1] - 1)
    n_distinct = batch[:, :-1].unique().numel()
    print(f"\n{title}: V={cfg.vocab_size:,} D={cfg.d_model} layers={cfg.n_layer} "
          f"batch={tokens:,} tokens ({n_distinct:,} distinct ids) "
          f"{'compiled' if compile_model else 'eager'} on {device.type}, median of {repeats}")
    print(f"{'arm':<8}{'step ms':>10}{'tokens/s':>11}{'peak MB':>10}{'time / tied':>13}{'mem / tied':>12}")
    base_time, base_mem = statistics.median(times["tied"]), max(peaks["tied"], 1)
    for embedding in EMBEDDINGS:
        step = statistics.median(times[embedding])
        print(f"{embedding:<8}{step * 1e3:>10.1f}{tokens / step:>11,.0f}{peaks[embedding] / 2**20:>10.0f}"
              f"{step / base_time:>13.3f}{peaks[embedding] / base_mem:>12.3f}")


def bench_model(args, device):
    o200k = get_tokenizer("o200k_base")
    cpu_sized = size_model("tiny", vocab_size=padded_vocab(o200k.n_vocab),
                           lev_heads=8, lev_rank=64)  # the paper's LEV, full vocabulary
    bench_arms("o200k, CPU-sized backbone, paper LEV", cpu_sized,
               real_token_batch(o200k, 8, cpu_sized.seq_len), device, args.compile, args.repeats)
    demo = get_tokenizer("o200k_base", vocab_size=8192)
    tiny = size_model("tiny")
    bench_arms("tiny preset (demo vocabulary)", tiny, real_token_batch(demo, 16, tiny.seq_len),
               device, args.compile, args.repeats)
    bench_lev_alone(cpu_sized, real_token_batch(o200k, 8, cpu_sized.seq_len)[:, :-1].unique(), device, args.repeats)


def lev_forward_backward(lev, ids, reference):
    """LEV's share of a training step: E for the distinct ids, then the gradients of its parameters."""
    E = (lev.generate_reference if reference else lev.generate)(ids)
    E.backward(torch.ones_like(E))


def proc_status_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def lev_peak_bytes(cfg, ids, reference, device_name):
    """Peak memory of lev_forward_backward above where it starts. Run in a fresh process: on
    CPU, memory an earlier run freed but the process kept would hide part of the peak. A
    first call on a few ids compiles the fast path's kernels, whose memory is not LEV's."""
    device = torch.device(device_name)
    lev = LEV.from_config(cfg).to(device)
    lev_forward_backward(lev, ids[:64].to(device), reference)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        lev_forward_backward(lev, ids.to(device), reference)
        return torch.cuda.max_memory_allocated() - start
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # restart the peak resident size (VmHWM) from the current one
    start = proc_status_bytes("VmRSS")
    lev_forward_backward(lev, ids, reference)
    return proc_status_bytes("VmHWM") - start


def bench_lev_alone(cfg, ids, device, repeats):
    """LEV by itself at the paper's hyper-parameters: generate() against generate_reference(), the method
    written out (dense basis, plain matmul, all of phi kept for the backward), interleaved."""
    torch.manual_seed(0)
    lev = LEV.from_config(cfg).to(device)
    times = {False: [], True: []}
    for _, reference in itertools.product(range(repeats + 1), times):  # the first round warms up
        start = time.perf_counter()
        lev_forward_backward(lev, ids.to(device), reference)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times[reference].append(time.perf_counter() - start)
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a new process per task
        peaks = {reference: pool.apply(lev_peak_bytes, (cfg, ids, reference, device.type)) for reference in times}
    print(f"\nLEV alone, forward + backward for the {len(ids):,} distinct ids of the o200k batch above "
          f"(h={cfg.lev_heads} d_seed={cfg.lev_seed_dim} kappa={cfg.lev_knots} r={cfg.lev_rank} D={cfg.d_model}), "
          f"{device.type}, median of {repeats}; peak memory from a fresh process")
    print(f"{'path':<30}{'ms':>9}{'peak MB':>10}")
    for reference, label in ((True, "generate_reference (written out)"), (False, "generate (fast)")):
        print(f"{label:<30}{statistics.median(times[reference][1:]) * 1e3:>9.1f}{peaks[reference] / 2**20:>10.0f}")


def bench_data(args, device):
    """prepare_data.py (read, tokenize on all cores, write shards) against tiktoken's own batched
    encoding of the same documents on the same cores. prepare_data.py runs as a command and
    reports each split's tokens/s, which leave out its start-up (imports, tokenizer)."""
    tokenizer = get_tokenizer("o200k_base", vocab_size=8192)
    docs = list(demo_documents())
    rates = {"tiktoken": [], "prepare_data": []}
    for _ in range(args.repeats):  # interleaved, like the model benchmark
        start = time.perf_counter()
        encoded = tokenizer.enc.encode_ordinary_batch(docs, num_threads=os.cpu_count())
        rates["tiktoken"].append((sum(map(len, encoded)) + len(docs)) / (time.perf_counter() - start))
        with tempfile.TemporaryDirectory() as out_dir:
            result = subprocess.run([sys.executable, PREPARE_DATA, "--dataset=demo", f"--out_dir={out_dir}"],
                                    check=True, capture_output=True, text=True)
        splits = [(int(tokens.replace(",", "")), int(rate.replace(",", ""))) for tokens, rate in
                  re.findall(r"^\w+: [\d,]+ documents, ([\d,]+) tokens, ([\d,]+) tokens/s$", result.stdout, re.M)]
        tokens = sum(n for n, _ in splits)
        rates["prepare_data"].append(tokens / sum(n / rate for n, rate in splits))
    tiktoken_rate, our_rate = (statistics.median(r) for r in rates.values())
    print(f"\ntokenization, demo corpus ({tokens:,} tokens, {os.cpu_count()} cores), median of {args.repeats}")
    print(f"tiktoken encode_ordinary_batch {tiktoken_rate:,.0f} tokens/s; prepare_data.py "
          f"{our_rate:,.0f} tokens/s; ratio {our_rate / tiktoken_rate:.2f} (target >= 0.80)")


def bench_sample(args, device):
    """Generation with and without the KV cache at a 512-token context, and the one-off
    cost of freezing LEV into a table for the full o200k vocabulary at the paper's D."""
    torch.manual_seed(0)
    model = Model(size_model("tiny", seq_len=1024)).to(device).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # the zero-init head would give a constant
    model.freeze_lev()
    prompt = torch.randint(0, model.cfg.vocab_size, (512,)).tolist()
    new_tokens = 64
    rates = {True: [], False: []}
    list(generate(model, prompt[:16], 4, temperature=0))  # warm-up
    for _, use_cache in itertools.product(range(args.repeats), (True, False)):
        start = time.perf_counter()
        n = sum(1 for _ in generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache))
        rates[use_cache].append(n / (time.perf_counter() - start))
    cached, uncached = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"\ngeneration, tiny preset, 512-token prompt + {new_tokens} new tokens, {device.type}, "
          f"median of {args.repeats}")
    print(f"with KV cache {cached:,.0f} tokens/s; without {uncached:,.0f} tokens/s; "
          f"speed-up {cached / uncached:.1f}x (target >= 5x)")
    lev = LEV(padded_vocab(get_tokenizer("o200k_base").n_vocab), 2048).to(device)
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        lev.as_table()
        elapsed = time.perf_counter() - start
    print(f"freezing LEV for {lev.vocab_size:,} ids at D=2048 (paper hyper-parameters): "
          f"{elapsed:.1f} s, peak {memory.peak / 2**20:,.0f} MB")


def bench_train(args, device):
    """The real training loop (train.py on the demo corpus, tiny preset): tokens/s of each arm,
    runs interleaved. Needs `python prepare_data.py --dataset=demo` first."""
    rates, steps = {e: [] for e in EMBEDDINGS}, 60
    tiny_batch_tokens = resolve({"size": "tiny"}).batch_tokens
    with tempfile.TemporaryDirectory() as tmp:
        for repeat, embedding in itertools.product(range(args.repeats), EMBEDDINGS):
            out_dir, output = os.path.join(tmp, f"{embedding}{repeat}"), os.path.join(tmp, f"{embedding}{repeat}.txt")
            code, _ = runs.wait(runs.start(["--size=tiny", "--data_dir=data/demo", f"--device={device.type}",
                                            f"--embedding={embedding}", f"--total_tokens={steps * tiny_batch_tokens}",
                                            "--eval_interval=1000", f"--out_dir={out_dir}"], output=output))
            if code:
                with open(output) as f:
                    raise UserError(f"train.py failed (exit status {code}): {error_line(f.read())}")
            # the first log interval includes start-up; the rest is steady-state training
            rates[embedding] += [r["tokens_per_s"] for r in runs.log_records(out_dir, "train") if r["step"] > 10]
    print(f"\ntraining loop, tiny preset on the demo corpus, {device.type} ({args.repeats} interleaved runs of {steps} steps)")
    base = statistics.median(rates["tied"])
    for embedding in EMBEDDINGS:
        rate = statistics.median(rates[embedding])
        print(f"{embedding:<8}{rate:>10,.0f} tokens/s   step time / tied {base / rate:.3f}")


def bench_loss(args, device):
    """The loss at the o200k configuration (2,048 positions, D = 128, V = 200,064), forward and
    backward through the head: F.cross_entropy on the full float32 logits against the chunked
    linear_cross_entropy that Model.forward uses, interleaved."""
    torch.manual_seed(0)
    n, d_model, vocab = 2048, 128, padded_vocab(get_tokenizer("o200k_base").n_vocab)
    x = torch.randn(n, d_model, device=device, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, d_model, device=device)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=device)
    ways = {"full logits": lambda: F.cross_entropy(F.linear(x, weight).float(), targets),
            "chunked": lambda: linear_cross_entropy(x, weight, targets)}
    times, peaks = {way: [] for way in ways}, {way: 0 for way in ways}
    for _, way in itertools.product(range(args.repeats + 1), ways):
        x.grad = weight.grad = None
        with PeakMemory(device) as memory:
            start = time.perf_counter()
            ways[way]().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[way].append(time.perf_counter() - start)
        peaks[way] = max(peaks[way], memory.peak)
    print(f"\nloss through the head, {n:,} positions x V={vocab:,}, D={d_model}, {device.type}, "
          f"median of {args.repeats} (after one warm-up)")
    for way in ways:
        print(f"{way:<12} {statistics.median(times[way][1:]) * 1e3:>8.1f} ms {peaks[way] / 2**20:>8,.0f} MB peak")
    print(f"chunked / full: time {statistics.median(times['chunked'][1:]) / statistics.median(times['full logits'][1:]):.3f}, "
          f"peak memory {peaks['chunked'] / max(peaks['full logits'], 1):.3f}")


# ---------------------------------------------------------------------------- gpu: the acceptance test
#
# `python -m experiments.bench gpu` runs train.py as a user does (torch.compile, bf16 autocast, fused AdamW, each
# size's micro-batch of 16 x 512) on the demo corpus with the full o200k vocabulary, and passes or fails:
#   200m with --deterministic, 4 micro-batches (32,768 tokens) a step: a run of 10 steps and, beside it,
#     one stopped at step 5 and then resumed (the resume check); with 2+ GPUs the 10 steps also on 2 GPUs
#     (the DDP check). Memory: the uninterrupted run and, with DDP, its rank 0. Speed: the resumed half.
#   1.2b as a user runs it, 2 micro-batches (16,384 tokens) a step, 6 steps: memory, speed (the MFU
#     floor), and the micro-step that LEV's share is taken of.
# Before the runs, two references on the GPU itself (the runs compare only the GPU with itself):
# LEV's fast path against generate_reference in float64 at the 1.2b LEV, and the chunked loss
# against F.cross_entropy under bf16 autocast at the 1.2b head. From the 200m lev run's log: its
# first loss against ln V (a zero head) and its last against its first (it learns).
# Two micro-batches or more a step: the peak comes in a micro-step after the first, with the earlier
# ones' gradients held beside the activations, as in real training (the README's estimates count them).
# No run reaches its end (--total_tokens is 1000 steps; each stops at --stop_step, saving a checkpoint),
# so none evaluates, which would compile the model once more. The schedule is the size's, after a
# 2-step warmup.
#
# Time on one H100/H200, estimated before any GPU run (the last lines printed give the measured one):
#   steps    200m: 1.25 GFLOP a token (Model.flops_per_token: 6N + attention) x 32,768 = 41 TFLOP a step;
#            1.2b: 7.52 GFLOP x 16,384 = 123 TFLOP. At 35% of 989 TFLOP/s, 0.12 s and 0.36 s (twice
#            that for --deterministic): ~3 s a run, negligible.
#   start    ~10 s a process (imports, the o200k tokenizer); +10 s to build 1.2b's weights on the CPU.
#   compile  assumed cold: 1.5 min at 200m, 2 min at 1.2b; ~30 s when inductor's on-disk cache has it.
#   save     2.5 GB at 200m, 14.7 GB at 1.2b: 12 s and 75 s at 5 s/GB (a slow disk), 2 s and 10 s on NVMe.
#   data     the demo corpus with o200k, the first time only: 5 s on a 2-core VM, say 10 s.
#   total    with a slow disk: data 10 s + the first two 200m runs, side by side (start 10, compile 90,
#            steps 3, two saves on one disk 25) 130 s + the resumed half (start 10, load 3, compile 30,
#            steps 2, save 12) 55 s + 1.2b (start and build 20, compile 120, steps 3, save 75) 220 s +
#            LEV alone (its compilation, partly cached) 40 s + the references (LEV's kernels compiled,
#            ~25 GB of float32 logits and gradients) 30 s = 485 s, 8 min. With NVMe ~390 s, 6.5 min.
#            With 2+ GPUs the DDP run (a graph of its own to compile) joins the first two: ~+0.5 min.
#   budget   RUNS_END_S bounds the whole: with the slow disk the runs would end at ~445 s, past it, and
#            the 1.2b run is stopped while it saves (its memory, MFU and graph checks, read from its
#            log, are measured by then; its exit fails the test, naming the budget).

def saved_by_compiled_graph(cfg, tokens):
    """Bytes the compiled lev model saves for backward on one micro-batch of `tokens` ids under
    bf16 autocast (inductor on this CPU; its partitioner decides what to save as on a GPU),
    parameters themselves excluded: what the backward keeps alive on top of the weights."""
    torch._dynamo.reset()
    model = Model(cfg)
    model.compile()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def record(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    idx = torch.randint(0, cfg.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor), torch.autocast("cpu", torch.bfloat16):
        model(idx, idx)
    return sum(saved.values())


def parameter_count(cfg):
    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in Model(cfg).parameters())


def memory_estimate(size):
    """Bytes per GPU for the lev arm of a paper size at its micro-batch, by part. What the compiled
    graph saves is measured at 1 and 2 layers and 128 and 256 tokens, and fitted as
    a + b*layers + c*tokens + d*layers*tokens: b is each layer's bf16 weight copies, d its activations."""
    preset, base = resolve({"size": size}), size_model(size, embedding="lev")
    m = {(layers, tokens): saved_by_compiled_graph(dataclasses.replace(base, n_layer=layers, seq_len=tokens), tokens)
         for layers in (1, 2) for tokens in (128, 256)}
    d = (m[2, 256] - m[1, 256] - m[2, 128] + m[1, 128]) / 128
    b = m[2, 128] - m[1, 128] - 128 * d
    c = (m[1, 256] - m[1, 128]) / 128 - d
    a = m[1, 128] - b - 128 * c - 128 * d
    layers, tokens, V, D = base.n_layer, preset.micro_batch * base.seq_len, base.vocab_size, base.d_model
    chunk = max(1, min(tokens, LOSS_CHUNK_LOGITS // V))
    # The peak comes with every activation saved: at the end of forward, inside the loss (a chunk's
    # bf16 logits, overwritten by G in the fused step; the bf16 head and a bf16 [V, D] product), or at
    # the start of backward (dL/dW scaled, float32 [V, D], and a layer's activation gradients), the larger.
    in_flight = max(chunk * V * 2 + 2 * V * D * 2, V * D * 4 + d * tokens)
    return {
        "weights, gradients, AdamW (16 B per parameter)": 16 * parameter_count(base),
        "bf16 weight copies saved": b * layers,
        f"activations saved ({d / D:.0f} D bytes per token and layer)": d * layers * tokens,
        "embedding, final norm, loss gradients saved": a + c * tokens,
        "in flight at the peak (the loss's chunk, or backward's first step)": in_flight,
    }


def bench_memory(args, device):
    """The README's memory table: GB per GPU for each paper size's lev arm, part by part."""
    for size in ("200m", "400m", "1.2b"):
        parts = memory_estimate(size)
        preset = resolve({"size": size})
        print(f"\n{size}, lev, micro-batch {preset.micro_batch} x {preset.seq_len}, one GPU or DDP (GB)")
        for name, value in parts.items():
            print(f"  {name:<64}{value / 1e9:6.2f}")
        print(f"  {'total (DDP adds nothing: the gradients are its buckets)':<64}{sum(parts.values()) / 1e9:6.2f}"
              f"   (README and experiments.bench gpu: {MEMORY_ESTIMATE_GB[size][0]})", flush=True)


# The README's memory estimates ("Memory and time"), GB per GPU at micro-batch 16 x 512: (one GPU,
# with DDP), `python -m experiments.bench memory` rounded up. The README's table must say the same
# (test_bench_gpu_memory_estimates_match_the_readme).
MEMORY_ESTIMATE_GB = {"200m": (8, 8), "400m": (15, 15), "1.2b": (37, 37)}  # DDP: gradients are bucket views

# Each check's threshold, and why. A check fails when its figure is above it, or was not measured.
THRESHOLDS = {
    # resume: the largest |loss difference| between the 200m run stopped at step 5 and resumed and the
    # uninterrupted one, both --deterministic. The README promises bit-identical losses, so any
    # difference is a bug (state not saved or not restored, the data position off).
    "resume": 0.0,
    # ddp: the same, 2 GPUs with DDP against one GPU's accumulation over the same batches. The gradients
    # are summed in another order, which moves the last bits; a gradient left out of the all-reduce,
    # or a micro-step counted twice, moves the losses by far more than 1e-3.
    "ddp": 1e-3,
    # eager: outputs holding EAGER_WARNING (the train.py runs, and LEV timed here). Eager, LEV writes
    # phi to memory and is several times slower, the loss passes ~3x as often over its logits: on a
    # GPU their kernels must compile.
    "eager": 0,
    # memory: the peak memory the CUDA allocator reserved (what must fit the GPU) above the README's
    # estimate, as a fraction of it. Users size GPUs and --micro_batch by the estimate; 10% covers
    # the allocator's rounding and fragmentation.
    "memory": 0.10,
    # lev_share: LEV's forward + backward for a 1.2b micro-batch of Pile-like ids (ZIPF_EXPONENT), as
    # a fraction of a whole 1.2b micro-step. The micro-step is ~62 TFLOP of bf16 matmuls, LEV ~0.03
    # TFLOP in float32 plus dozens of small kernels and one wait for the GPU: ~1-3% expected (1.7%
    # of the o200k step on a CPU). 5% catches LEV off its fast path (phi written to memory, eager
    # kernels, a wait per chunk) and leaves room for launch overheads; the paper's v1 cost 23-51%.
    "lev_share": 0.05,
    # lev_reference: LEV's fast path on this GPU (fused kernels, float32) against generate_reference in
    # float64 at the 1.2b LEV, 256 ids: the largest error of E and of each parameter's gradient, relative
    # to that tensor's largest entry. Float32 rounding of a 128-factor product gives ~1e-6; a wrong
    # kernel (an index, a slope, a chunk boundary) gives O(1). The CPU tests hold the same to 1e-5.
    "lev_reference": 1e-4,
    # loss_reference: the chunked loss under bf16 autocast against F.cross_entropy on the whole logits
    # under the same autocast, at the 1.2b head and a micro-batch: the loss's relative error and the
    # largest error of dL/dx and dL/dW relative to each one's largest entry. Both round the softmax's
    # gradient to bf16 for the matmuls (~4e-3 relative); a chunk lost or counted twice gives O(1).
    "loss_reference": 2e-2,
    # first_loss: |the first logged loss - ln V| of the 200m lev run. Its head starts at zero, so every
    # logit is 0 and the loss is ln V to float32 rounding; anything else means the head did not start at
    # zero, the loss is not the mean, or padding ids count wrongly.
    "first_loss": 1e-3,
    # loss_falls: the 200m run's loss at its last step over its first (10 steps of lr 6e-4 after 2 of
    # warmup, the demo corpus): a model that learns falls well below 0.9; gradients that do not reach
    # the weights leave it near 1.
    "loss_falls": 0.9,
    # mfu 1.2b (a floor: it fails below): the 1.2b run's median model FLOPs utilisation on one GPU,
    # compiled, bf16, micro-batch 16 x 512. Dense bf16 matmuls of this size reach 35-50% of an H100's
    # peak; 20% leaves room for LEV, the loss's eager chunks and a short run's noise, and catches the
    # model running eagerly, a graph break per layer or a host sync per kernel (all well below it).
    "mfu 1.2b": 0.20,
    # graph_breaks 1.2b: graph breaks TorchDynamo met in the 1.2b run (train.py logs its counters).
    # LEV.forward and the product are kept out of the graphs on purpose (leviathan.py, "What
    # torch.compile sees"): a handful. One per block would be 16 or more.
    "graph_breaks 1.2b": 10,
    # recompiles 1.2b: graphs compiled after the run's second step, when every shape has been met
    # (LEV's generator is compiled for any number of ids): a guard that a new id bucket fails may cost
    # one or two; a graph per step means the shapes are not bounded.
    "recompiles 1.2b": 2,
}
FLOORS = {"mfu 1.2b"}  # checks that fail below their threshold; the others fail above it

# LEV's cost grows with the distinct ids of a micro-batch, so its share is measured on ids drawn with
# P(rank r) ~ r^-ZIPF_EXPONENT over the vocabulary, the ranks shuffled over the ids. Zipf's law with
# exponent 1 gives ~3,900 distinct o200k ids in 16 x 512 tokens: the top of The Pile's ~2,000-4,000,
# so LEV is timed on its expensive side (1.1 would give ~2,800). The demo corpus has ~1,500.
ZIPF_EXPONENT = 1.0

# --toy (not in --help): the whole flow in seconds on a CPU, for the test suite. Both sizes become this
# micro model, trained on the --data_dir given.
TOY = dict(size="tiny", d_model=32, n_layer=1, n_head=2, seq_len=32, micro_batch=8, lev_seed_dim=16, lev_heads=2,
           lev_knots=4, lev_rank=8)
EAGER_WARNING = "runs eagerly (slower)"  # LEV's or the loss's kernels: Fused
STEPS = 10  # of the 200m runs; the resume check stops one after STEPS // 2
RUN_TIMEOUT_S = 900  # a train.py run still going after 15 minutes has hung (a collective): stopped, failed
# The whole test ends within 8 minutes of its start by construction, whatever the disk and compiler
# cost (a lent GPU comes with ~15 minutes, start-up included): a train.py run still going 7 minutes
# after the start is stopped, and the checks it was to measure fail as not measured; LEV alone, the
# last part, takes ~40 s of the minute left.
RUNS_END_S = 7 * 60


def check_gpu_options(args, device):
    """Refuse at once, before any section runs, what would make `gpu` fail late or delete files."""
    if device.type != "cuda" and not args.toy:
        raise UserError("`python -m experiments.bench gpu` needs a CUDA GPU (this machine has none); "
                        "the other sections run on CPU")
    if os.path.exists(args.out_dir) and not (os.path.isdir(args.out_dir) and not os.listdir(args.out_dir)):
        raise UserError(f"--out_dir={args.out_dir} exists and is not an empty folder; the runs go there and it is "
                        "deleted at the end: give a new or empty folder")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UserError(f"--json={args.json}: its folder does not exist")


def bench_gpu(args, device):
    """The GPU acceptance test (this section's first comment): every figure goes to --json, also when
    a check fails or a run crashes; the run folder is deleted; exit status 1 if any check fails."""
    start = time.time()
    figures = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   gpus=torch.cuda.device_count() if device.type == "cuda" else 1, torch=torch.__version__,
                   toy=args.toy, runs={}, checks={}, skipped={}, seconds={})
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"\nGPU acceptance test: {figures['gpus']} x {figures['device']}, torch {torch.__version__}; "
          f"runs in {args.out_dir} (deleted at the end)", flush=True)
    try:
        measure_gpu(args, device, figures, start)
    finally:
        shutil.rmtree(args.out_dir, ignore_errors=True)
        figures["wall_s"] = round(time.time() - start, 1)
        figures["thresholds"] = {check: threshold(check) for check in figures["checks"]}
        figures["failures"] = gpu_failures(figures)
        write_json(args.json, figures)
    report_gpu(figures, args.json)
    if figures["failures"]:
        sys.exit(1)


def measure_gpu(args, device, figures, start):
    """The checks due here, entered as None (not measured) first, so that a run that crashes fails
    them; the train.py runs (ended by start + RUNS_END_S); their figures; then LEV alone."""
    cuda, ddp, checks = device.type == "cuda", figures["gpus"] >= 2, figures["checks"]
    checks.update({"resume": None, **({"ddp": None} if ddp else {}), "eager": None})
    if cuda:
        checks.update({"memory 200m": None, **({"memory 200m ddp": None} if ddp else {}), "memory 1.2b": None})
    checks.update({"lev_share": None, "lev_reference": None, "loss_reference": None, "first_loss": None,
                   "loss_falls": None,
                   **({"mfu 1.2b": None, "graph_breaks 1.2b": None, "recompiles 1.2b": None} if cuda else {})})
    figures["skipped"].update({} if ddp else {"ddp": "one GPU (DDP needs 2)"})
    figures["skipped"].update({} if cuda else {"memory": "no CUDA allocator on a CPU",
                                               "mfu 1.2b": "no peak FLOP/s for a CPU",
                                               "compiler": "the runs are not compiled on a CPU"})
    part = timed_parts(figures["seconds"])
    with part("data"):
        prepare_o200k_demo(args.data_dir)
    with part("references"):
        checks["lev_reference"] = lev_reference_error(args.data_dir, device, shape_of("1.2b", args.toy))
        checks["loss_reference"] = loss_reference_error(args.data_dir, device, shape_of("1.2b", args.toy))
    with part("train.py runs"):
        outputs = train_runs(args, device, ddp, figures["runs"], deadline=start + RUNS_END_S)
    read_runs(args.out_dir, outputs, figures)
    with part("LEV alone"):
        figures["lev"] = lev_figures(args.data_dir, device, shape_of("1.2b", args.toy))
    if figures["speed"]["1.2b"]:  # on the safe side: the micro-step timed had its own LEV call on fewer ids
        checks["lev_share"] = figures["lev"]["seconds"] / figures["speed"]["1.2b"]["micro_step_s"]
    checks["eager"] = sum(EAGER_WARNING in output for output in outputs.values()) + len(Fused.warned)


def timed_parts(seconds):
    """part(name): a context that adds the seconds its block took to seconds[name], and prints them,
    so that a slow acceptance run shows where its time went."""
    @contextlib.contextmanager
    def part(name):
        start = time.time()
        try:
            yield
        finally:
            seconds[name] = round(time.time() - start, 1)
            print(f"  {name}: {seconds[name]:.0f} s", flush=True)
    return part


def shape_of(size, toy):
    """train.py's options for a size's model: the preset, or TOY."""
    return TOY if toy else {"size": size}


def micro_batch_shape(shape):
    """(sequences, tokens per sequence) of one micro-batch of a shape."""
    preset = resolve({"size": shape["size"]})
    return shape.get("micro_batch", preset.micro_batch), shape.get("seq_len", preset.seq_len)


def train_options(args, device, shape, micro_batches, run_dir, stop_step):
    """train.py's options: the shape, micro_batches micro-batches a step, stopped after stop_step steps
    of a 1000-step schedule."""
    micro_tokens = math.prod(micro_batch_shape(shape))
    return [*(f"--{key}={value}" for key, value in shape.items()), f"--data_dir={args.data_dir}",
            f"--out_dir={run_dir}", f"--device={device.type}", f"--batch_tokens={micro_batches * micro_tokens}",
            f"--total_tokens={1000 * micro_batches * micro_tokens}", "--warmup_steps=2", "--log_interval=1",
            f"--eval_tokens={micro_tokens}", f"--stop_step={stop_step}"]


def train_runs(args, device, ddp, results, deadline):
    """The train.py runs, in three stages (this section's first comment), each stopped at the deadline
    (time.time() seconds) if still going; their outputs by name."""
    small, large = shape_of("200m", args.toy), shape_of("1.2b", args.toy)

    def options(shape, folder, micro_batches, stop_step, *more):
        return train_options(args, device, shape, micro_batches, os.path.join(args.out_dir, folder), stop_step) + [*more]

    first = {"200m-whole": (options(small, "200m-whole", 4, STEPS, "--deterministic"), 1),
             "200m-stopped": (options(small, "200m-resumed", 4, STEPS // 2, "--deterministic"), 1)}
    if ddp:
        first["200m-ddp"] = (options(small, "200m-ddp", 4, STEPS, "--deterministic"), 2)
    outputs = run_stage(first, args.out_dir, results, deadline)
    if results["200m-stopped"]["exit"] == 0:
        resumed = options(small, "200m-resumed", 4, STEPS, "--deterministic", "--resume")
        outputs |= run_stage({"200m-resumed": (resumed, 1)}, args.out_dir, results, deadline)
    return outputs | run_stage({"1.2b": (options(large, "1.2b", 2, 6), 1)}, args.out_dir, results, deadline)


def read_runs(out_dir, outputs, figures):
    """From the runs' logs and outputs: the loss differences, each run's peak memory and checkpoint,
    and the speed of the two runs timed."""
    logs = {folder: runs.log_records(os.path.join(out_dir, folder), "train")
            for folder in ("200m-whole", "200m-resumed", "200m-ddp", "1.2b")}
    checks = figures["checks"]
    checks["resume"] = largest_loss_difference(logs["200m-whole"], logs["200m-resumed"], STEPS)
    if "ddp" in checks:
        checks["ddp"] = largest_loss_difference(logs["200m-whole"], logs["200m-ddp"], STEPS)
    by_run = {**logs, "200m-stopped": [r for r in logs["200m-resumed"] if r["step"] <= STEPS // 2],
              "200m-resumed": [r for r in logs["200m-resumed"] if r["step"] > STEPS // 2]}  # one folder, two runs
    for name, run in figures["runs"].items():
        run.update(**peak_memory(by_run[name]), **checkpoint_figures(outputs[name]))
    for check, name in (("memory 200m", "200m-whole"), ("memory 200m ddp", "200m-ddp"), ("memory 1.2b", "1.2b")):
        if check in checks:
            checks[check] = figures["runs"][name]["peak_reserved_gb"]
    figures["speed"] = {"200m-resumed": speed(by_run["200m-resumed"], 4, os.path.join(out_dir, "200m-resumed"),
                                              figures["device"]),
                        "1.2b": speed(by_run["1.2b"], 2, os.path.join(out_dir, "1.2b"), figures["device"])}
    whole = logs["200m-whole"]
    if whole:
        vocab_size = json.load(open(os.path.join(out_dir, "200m-whole", "config.json")))["model"]["vocab_size"]
        checks["first_loss"] = abs(whole[0]["loss"] - math.log(vocab_size)) if whole[0]["step"] == 1 else None
        checks["loss_falls"] = whole[-1]["loss"] / whole[0]["loss"] if whole[-1]["step"] == STEPS else None
    if "mfu 1.2b" in checks and figures["speed"]["1.2b"]:
        checks["mfu 1.2b"] = figures["speed"]["1.2b"]["mfu"]
    compiled = [r for r in logs["1.2b"] if "graphs" in r]
    if "graph_breaks 1.2b" in checks and len(compiled) >= 2:
        checks["graph_breaks 1.2b"] = compiled[-1]["graph_breaks"]
        checks["recompiles 1.2b"] = compiled[-1]["graphs"] - compiled[1]["graphs"]


def prepare_o200k_demo(data_dir):
    """The demo corpus with the full o200k vocabulary (offline), prepared the first time only."""
    if os.path.exists(os.path.join(data_dir, "meta.json")):
        return
    print(f"preparing {data_dir}: the demo corpus with the full o200k vocabulary", flush=True)
    result = subprocess.run([sys.executable, PREPARE_DATA, "--dataset=demo", "--vocab_size=0",
                             f"--out_dir={data_dir}"], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"prepare_data.py could not prepare {data_dir}: "
                        + (result.stderr.strip().splitlines() or ["no message"])[-1])


def run_stage(stage, out_dir, results, deadline):
    """Start train.py runs together and wait for all of them: stage is {name: (options, processes)}.
    Each writes its output to out_dir/<name>.txt; one still going at the deadline, or that hangs (a
    collective) past RUN_TIMEOUT_S, is killed, and every one on Ctrl-C, torchrun's workers included
    (runs.py). Enters {exit, seconds, error} for each in results; returns {name: output}."""
    print(f"running {', '.join(stage)}" + (" together" if len(stage) > 1 else ""), flush=True)
    started = {}
    try:
        for name, (options, processes) in stage.items():
            started[name] = runs.start(options, processes, os.path.join(out_dir, f"{name}.txt")), time.time()
        outputs = {}
        for name, (process, start) in started.items():
            budget_ends = deadline < start + RUN_TIMEOUT_S
            code, stopped = runs.wait(process, deadline=min(deadline, start + RUN_TIMEOUT_S), stop_signal=signal.SIGKILL)
            with open(os.path.join(out_dir, f"{name}.txt")) as f:
                outputs[name] = f.read()
            error = (None if code == 0 else error_line(outputs[name]) if not stopped
                     else f"stopped at the test's time budget ({RUNS_END_S // 60} min after its start)" if budget_ends
                     else f"stopped after {RUN_TIMEOUT_S} s")
            results[name] = dict(exit=code, seconds=round(time.time() - start, 1), error=error)
            print(f"  {name}: exit status {code} after {results[name]['seconds']:.0f} s"
                  + (f": {error}" if error else ""), flush=True)
        return outputs
    finally:
        for process, _ in started.values():  # Ctrl-C, or an error here: the runs not yet waited for
            runs.stop(process, signal.SIGKILL)


def error_line(output):
    """What a failed run said: train.py's one `error:` line, else the first line naming an exception
    (a worker's, before torchrun's own; [rankN]: prefixes dropped), else its last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in output.strip().splitlines()] or ["no output"]
    return next((line for line in lines if line.startswith("error:")), None) or next(
        (line for line in lines if re.match(r"\w+(\.\w+)*(Error|Exception)\b", line)), lines[-1])


def largest_loss_difference(a, b, steps):
    """The largest |loss difference| of two runs' records over steps 1..steps; None unless both logged
    every one of them."""
    losses = [{r["step"]: r["loss"] for r in records} for records in (a, b)]
    if any(step not in run for run in losses for step in range(1, steps + 1)):
        return None
    return max(abs(losses[0][step] - losses[1][step]) for step in range(1, steps + 1))


def peak_memory(records):
    """The highest peak memory a run logged (train.py logs the peaks since its start), in GB; None
    where it logged none (a CPU, or a run that crashed first)."""
    return {key: max((r[key] for r in records if key in r), default=None)
            for key in ("peak_reserved_gb", "peak_mem_gb")}


def checkpoint_figures(output):
    """Size and write time of the last checkpoint a run's output reports; None where it reports none."""
    found = re.findall(r"^checkpoint: step \d+, ([\d.]+) GB.*? in ([\d.]+) s", output, re.M)
    size, seconds = map(float, found[-1]) if found else (None, None)
    return dict(checkpoint_gb=size, checkpoint_s=seconds)


# Peak dense bf16 FLOP/s per GPU (vendors' data sheets), for MFU; a variant before the plain name.
PEAK_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "GH200": 989e12, "H200 NVL": 835e12,
              "H200": 989e12, "GB200": 2500e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device_name):
    """The first PEAK_FLOPS entry made of whole words of the name (a GB200 is no B200); None: no MFU, not a wrong one."""
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    return next((flops for key, flops in PEAK_FLOPS.items() if set(key.upper().split()) <= words), None)


def speed(records, micro_batches, run_dir, device_name):
    """Median tokens/s and MFU (Model.flops_per_token x tokens/s over one GPU's peak) of one process's steps but its
    first two (compilation, first allocations), and the time of one micro-step; None if there are none."""
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


def zipf_ids(vocab_size, shape, exponent, seed=0):
    """Token ids drawn with P(rank r) ~ r^-exponent, the ranks shuffled over the ids."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, vocab_size + 1, dtype=torch.float64) ** -exponent
    ranks = torch.multinomial(weights, math.prod(shape), replacement=True, generator=generator)
    return torch.randperm(vocab_size, generator=generator)[ranks].view(shape)


def shape_config(data_dir, shape):
    """The lev model of a shape (a size, or TOY) at the data's vocabulary."""
    vocab_size = load_meta(data_dir)["vocab_size"]
    model_fields = {f.name for f in dataclasses.fields(Config)}
    return size_model(shape["size"], vocab_size=padded_vocab(vocab_size),
                      **{key: value for key, value in shape.items() if key in model_fields})


def relative_error(got, want):
    """The largest |got - want|, relative to want's largest entry."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def lev_reference_error(data_dir, device, shape):
    """LEV's fast path on the device against generate_reference in float64 (THRESHOLDS): the largest
    relative error of E and of every parameter's gradient, for 256 distinct Zipf ids."""
    cfg = shape_config(data_dir, shape)
    ids = zipf_ids(cfg.vocab_size, (4096,), ZIPF_EXPONENT).unique()[:256].to(device)
    torch.manual_seed(0)
    lev = LEV.from_config(cfg).to(device)
    reference = LEV.from_config(cfg).to(device, torch.float64)
    reference.load_state_dict(lev.state_dict())
    probe = torch.randn(len(ids), cfg.d_model, device=device, dtype=torch.float64)  # dL/dE, the same for both
    fast, exact = lev.generate(ids), reference.generate_reference(ids)
    (fast * probe.float()).sum().backward()
    (exact * probe).sum().backward()
    errors = [relative_error(fast, exact)] + [relative_error(p.grad, q.grad) for p, q in
                                               zip(lev.parameters(), reference.parameters())]
    return max(errors)


def loss_reference_error(data_dir, device, shape):
    """The chunked loss under bf16 autocast against F.cross_entropy on the whole logits under the same
    autocast (THRESHOLDS): the largest relative error of the loss, dL/dx and dL/dW, for one micro-batch
    of the shape's tokens at its head."""
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


def lev_figures(data_dir, device, shape):
    """LEV's forward and backward for one micro-batch of the shape, of Zipf-distributed ids over the
    data's vocabulary, as the model runs it: compiled on CUDA (as train.py does it), under bf16
    autocast (which LEV turns off inside). The median of 10 calls after 3 (compilation, warm-up)."""
    ids = zipf_ids(load_meta(data_dir)["vocab_size"], micro_batch_shape(shape), ZIPF_EXPONENT).to(device)
    cfg = shape_config(data_dir, shape)
    torch.manual_seed(0)
    lev = LEV.from_config(cfg).to(device)
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


# ---------------------------------------------------------------------------- gpu: the verdict


def threshold(check):
    """A check's threshold: THRESHOLDS, or for memory the README's estimate for the size (one GPU, or
    DDP's per GPU) + 10%."""
    if check.startswith("memory"):
        _, size, *ddp = check.split()
        return MEMORY_ESTIMATE_GB[size][1 if ddp else 0] * (1 + THRESHOLDS["memory"])
    return THRESHOLDS[check]


def shown(check, value):
    """A check's figure or threshold as printed."""
    if check.startswith("memory"):
        return f"{value:.1f} GB"
    return f"{value:.1%}" if check in ("lev_share", "mfu 1.2b") else f"{value:.3g}"


def check_lines(figures):
    """Every check as (passed, '<check>: <figure> vs <threshold>'): each run's exit status, then each
    figure in figures["checks"]; a figure of None (due, not measured) fails."""
    lines = [(run["exit"] == 0, f"run {name}: exit status {run['exit']}" + (f" ({run['error']})" if run["error"] else "")
              + " vs 0") for name, run in figures["runs"].items()]
    for check, figure in figures["checks"].items():
        limit = threshold(check)
        within = figure is not None and (figure >= limit if check in FLOORS else figure <= limit)
        lines.append((within,
                      f"{check}: {'not measured' if figure is None else shown(check, figure)} vs {shown(check, limit)}"))
    return lines


def gpu_failures(figures):
    """The verdict, a function of the figures alone: one 'FAIL <check>: <figure> vs <threshold>' line
    per failed check; [] when every check passes."""
    return [f"FAIL {line}" for passed, line in check_lines(figures) if not passed]


def cell(value, spec):
    return "-" if value is None else format(value, spec)


def report_gpu(figures, json_path):
    """The figures; every check, but the runs that passed (their lines came as they ended); the wall
    time; and PASS or FAIL, last."""
    print(f"\n{'run':<14}{'tokens/s':>10}{'MFU':>7}{'peak GB: reserved':>19}{'allocated':>11}{'checkpoint':>22}")
    for name, run in figures["runs"].items():
        speed_ = figures["speed"].get(name) or {}
        saved = (f"{run['checkpoint_gb']:.2f} GB in {run['checkpoint_s']:.1f} s" if run["checkpoint_gb"] is not None
                 else "-")
        print(f"{name:<14}{cell(speed_.get('tokens_per_s'), ',.0f'):>10}{cell(speed_.get('mfu'), '.1%'):>7}"
              f"{cell(run['peak_reserved_gb'], '.1f'):>19}{cell(run['peak_mem_gb'], '.1f'):>11}{saved:>22}")
    lev = figures["lev"]
    print(f"(the 200m runs use --deterministic)\nLEV alone, forward + backward: {lev['seconds'] * 1e3:.1f} ms for "
          f"{lev['distinct_ids']:,} distinct ids in {lev['tokens']:,} tokens (Zipf, exponent {lev['zipf_exponent']})\n")
    for passed, line in check_lines(figures):
        if not (passed and line.startswith("run ")):
            print(("ok   " if passed else "FAIL ") + line)
    for check, why in figures["skipped"].items():
        print(f"skip {check}: {why}")
    minutes, seconds = divmod(round(figures["wall_s"]), 60)
    n_checks, n_failed = len(check_lines(figures)), len(figures["failures"])
    parts = ", ".join(f"{name} {s:.0f} s" for name, s in figures["seconds"].items())
    print(f"wall time {minutes} min {seconds:02d} s ({parts}); every figure in {json_path}")
    print(f"FAIL: {n_failed} of {n_checks} checks" if n_failed else f"PASS: all {n_checks} checks")


SECTIONS = {"model": bench_model, "loss": bench_loss, "data": bench_data, "train": bench_train, "sample": bench_sample,
            "memory": bench_memory, "gpu": bench_gpu}


def bench(argv):
    parser = ArgumentParser("-m experiments.bench", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", help=f"any of: {', '.join(SECTIONS)} (default: all but gpu)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models (and LEV's generator)")
    parser.add_argument("--repeats", type=parse_number(int), default=5,
                        help="each figure is the median of this many runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    parser.add_argument("--out_dir", default=os.path.join("out", "bench-gpu"),
                        help="gpu: the folder of its runs and checkpoints, new or empty; deleted at the end")
    parser.add_argument("--json", default="bench_gpu.json", help="gpu: the file of every figure (written also on FAIL)")
    parser.add_argument("--data_dir", default=os.path.join("data", "demo-o200k"),
                        help="gpu: the demo corpus with the full o200k vocabulary (prepared there if missing)")
    parser.add_argument("--toy", action="store_true", help=argparse.SUPPRESS)  # gpu on a CPU in seconds: see TOY
    args = parser.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be >= 1 (each figure is a median over repeats)")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device={args.device}: must be cpu, or cuda on a machine with a CUDA GPU")
    device = torch.device(args.device)
    if "gpu" in args.sections:
        check_gpu_options(args, device)
    for section in args.sections or [name for name in SECTIONS if name != "gpu"]:
        SECTIONS[section](args, device)


if __name__ == "__main__":
    sys.exit(run_main(bench, sys.argv[1:]))
