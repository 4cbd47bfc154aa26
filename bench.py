"""Benchmarks that print figures; no test depends on them (timings vary by machine).

    python bench.py              # every section
    python bench.py model        # lev vs tied vs untied step time and peak memory
    python bench.py model --compile

Ratios are what to compare: each is measured within one run, the arms interleaved
step by step so that a machine slowing down affects all of them alike.
"""
import argparse
import itertools
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

from cli import ArgumentParser, UserError, run_main
from data import demo_documents, get_tokenizer
from leviathan import EMBEDDINGS, LEV, SIZES, Config, LinearCrossEntropy, Model, compile_lev, generate, padded_vocab


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
    cpu_sized = Config.from_size("tiny", vocab_size=padded_vocab(o200k.n_vocab),
                                 lev_heads=8, lev_rank=64)  # the paper's LEV, full vocabulary
    bench_arms("o200k, CPU-sized backbone, paper LEV", cpu_sized,
               real_token_batch(o200k, 8, cpu_sized.seq_len), device, args.compile, args.repeats)
    demo = get_tokenizer("o200k_base", vocab_size=8192)
    tiny = Config.from_size("tiny")
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
            result = subprocess.run([sys.executable, "prepare_data.py", "--dataset=demo", f"--out_dir={out_dir}"],
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
    model = Model(Config.from_size("tiny", seq_len=1024)).to(device).eval()
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
    tiny_batch_tokens = SIZES["tiny"].batch_tokens
    with tempfile.TemporaryDirectory() as tmp:
        for repeat, embedding in itertools.product(range(args.repeats), EMBEDDINGS):
            out_dir = os.path.join(tmp, f"{embedding}{repeat}")
            subprocess.run([sys.executable, "train.py", "--size=tiny", "--dataset=demo", f"--device={device.type}",
                            f"--embedding={embedding}", f"--total_tokens={steps * tiny_batch_tokens}", "--eval_interval=1000",
                            f"--out_dir={out_dir}"], check=True, capture_output=True)
            with open(os.path.join(out_dir, "log.jsonl")) as f:
                records = [json.loads(line) for line in f]
            # the first log interval includes start-up; the rest is steady-state training
            rates[embedding] += [r["tokens_per_s"] for r in records if r["type"] == "train" and r["step"] > 10]
    print(f"\ntraining loop, tiny preset on the demo corpus, {device.type} ({args.repeats} interleaved runs of {steps} steps)")
    base = statistics.median(rates["tied"])
    for embedding in EMBEDDINGS:
        rate = statistics.median(rates[embedding])
        print(f"{embedding:<8}{rate:>10,.0f} tokens/s   step time / tied {base / rate:.3f}")


def bench_loss(args, device):
    """The loss at the o200k configuration (2,048 positions, D = 128, V = 200,064), forward and
    backward through the head: F.cross_entropy on the full float32 logits against the chunked
    LinearCrossEntropy that Model.forward uses, interleaved."""
    torch.manual_seed(0)
    n, d_model, vocab = 2048, 128, padded_vocab(get_tokenizer("o200k_base").n_vocab)
    x = torch.randn(n, d_model, device=device, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, d_model, device=device)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=device)
    ways = {"full logits": lambda: F.cross_entropy(F.linear(x, weight).float(), targets),
            "chunked": lambda: LinearCrossEntropy.apply(x, weight, targets)}
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


def train_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["type"] == "train"]


def run_train(args, nproc=1):
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    result = subprocess.run(launcher + ["train.py", *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: train.py {' '.join(args)} failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")


def lev_seconds_per_micro_step(size, device):
    """LEV's forward and backward for the distinct ids of one micro-batch of real text (16 x 512)."""
    cfg = Config.from_size(size)
    lev = LEV.from_config(cfg).to(device)
    compile_lev(lev)
    ids = real_token_batch(get_tokenizer("o200k_base"), 16, cfg.seq_len).to(device)
    for _ in range(3):  # compile, warm up
        lev(ids).sum().backward()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        lev(ids).sum().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 10


def bench_gpu(args, device):
    """GPU acceptance: train.py as a user runs it (torch.compile, bf16 autocast, fused AdamW, the
    size's defaults) for 20 steps at 200m and 1.2b on the demo corpus with the full o200k vocabulary,
    stopped at step 10 and resumed; with 2+ GPUs, DDP against one GPU's accumulation."""
    if device.type != "cuda":
        raise UserError("`python bench.py gpu` needs a CUDA GPU (this machine has none); the other sections run on CPU")
    data = os.path.join("data", "demo-o200k")
    if not os.path.exists(os.path.join(data, "meta.json")):
        subprocess.run([sys.executable, "prepare_data.py", "--dataset=demo", "--vocab_size=0", f"--out_dir={data}"],
                       check=True, capture_output=True)
    steps, batch_tokens = 20, 512 * 512
    print(f"\nGPU acceptance: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, {steps} steps of "
          f"{batch_tokens:,} tokens per size (stopped at {steps // 2}, resumed), medians after 3 warm-up steps")
    print(f"{'size':<6}{'tokens/s':>12}{'MFU':>8}{'peak GB':>9}{'LEV share':>11}{'final loss':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in ("200m", "1.2b"):
            out = os.path.join(tmp, size)
            common = [f"--size={size}", f"--data_dir={data}", f"--out_dir={out}", f"--total_tokens={steps * batch_tokens}",
                      "--warmup_steps=5", "--eval_interval=1000000", "--eval_tokens=65536", "--log_interval=1"]
            run_train(common + [f"--stop_step={steps // 2}"])
            run_train(common + ["--resume"])
            records = train_log(out)
            steady = [r for r in records if r["step"] > 3 and r["step"] != steps // 2 + 1]  # not the compile steps
            step_seconds = batch_tokens / statistics.median(r["tokens_per_s"] for r in steady)
            micro_steps = batch_tokens // (16 * 512)  # the presets' micro_batch of 16 sequences of 512
            lev_share = lev_seconds_per_micro_step(size, device) * micro_steps / step_seconds
            print(f"{size:<6}{statistics.median(r['tokens_per_s'] for r in steady):>12,.0f}"
                  f"{100 * statistics.median(r.get('mfu', float('nan')) for r in steady):>7.1f}%"
                  f"{max(r['peak_mem_gb'] for r in records):>9.1f}{100 * lev_share:>10.1f}%{records[-1]['loss']:>12.4f}")
        if torch.cuda.device_count() >= 2:  # one GPU with 2x accumulation against 2 GPUs with DDP
            short = ["--size=200m", f"--data_dir={data}", f"--total_tokens={5 * batch_tokens}", "--warmup_steps=2",
                     "--eval_interval=1000000", "--eval_tokens=16384", "--log_interval=1"]
            run_train(short + [f"--out_dir={tmp}/one"])
            run_train(short + [f"--out_dir={tmp}/ddp"], nproc=2)
            gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(train_log(f"{tmp}/one"), train_log(f"{tmp}/ddp")))
            print(f"DDP on 2 GPUs vs 1 GPU with accumulation, 5 steps at 200m: largest loss difference {gap:.2e} "
                  f"({'within' if gap <= 1e-3 else 'OVER'} the 1e-3 target)")


SECTIONS = {"model": bench_model, "loss": bench_loss, "data": bench_data, "train": bench_train, "sample": bench_sample,
            "gpu": bench_gpu}


def bench(argv):
    parser = ArgumentParser("bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", help=f"any of: {', '.join(SECTIONS)} (default: all but gpu)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models (and LEV's generator)")
    parser.add_argument("--repeats", type=int, default=5, help="each figure is the median of this many runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be >= 1 (each figure is a median over repeats)")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device={args.device}: must be cpu, or cuda on a machine with a CUDA GPU")
    device = torch.device(args.device)
    for section in args.sections or [name for name in SECTIONS if name != "gpu"]:
        SECTIONS[section](args, device)


if __name__ == "__main__":
    sys.exit(run_main(bench, sys.argv[1:]))
