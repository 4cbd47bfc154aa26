"""Benchmarks that print figures; `gpu` is the GPU acceptance run's alias.

    python -m experiments.bench          # every section
    python -m experiments.bench model    # lev vs tied vs untied step time and peak memory
    python -m experiments.bench model --compile
    python -m experiments.bench memory   # the README's memory table: what the compiled graph saves, at each paper size
    python -m experiments.bench gpu      # python -m experiments.acceptance: PASS, FAIL or INCOMPLETE on a CUDA GPU

Ratios are what to compare: each is measured within one run, the arms interleaved
step by step so that a machine slowing down affects all of them alike. No test depends
on the figures (timings vary by machine); the acceptance run checks its own against thresholds.
"""
import argparse
import dataclasses
import itertools
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.bench")

import torch
import torch.nn.functional as F

from experiments import acceptance, runs
from experiments.acceptance import MEMORY_ESTIMATE_GB
from experiments.cli import run_main
from leviathan import EMBEDDINGS, LEV, LOSS_CHUNK_LOGITS, Config, Model, generate_text, linear_cross_entropy, padded_vocab
from prepare_data import UserError, demo_documents, get_tokenizer
from train import read_options

# The ids of each size's data folder: prepare_data.py's demo vocabulary and o200k_base's.
DATA_IDS = {"data/demo": 8192, "data/pile": 200_019}


def size_model(size, **overrides):
    """The model of a size in train.SIZES, on its own data's vocabulary, with some fields changed."""
    options = read_options([f"--size={size}"])
    return dataclasses.replace(Config.from_options(options, DATA_IDS[options.data_dir]), **overrides)


def real_token_batch(tokenizer, batch, seq_len):
    """Token ids of real text (the demo corpus), so the number of distinct ids per batch,
    which is what LEV's cost depends on, is realistic (random ids would inflate it)."""
    ids = []
    for doc in demo_documents():
        ids += tokenizer.encode_ordinary(doc) + [tokenizer.eot_token]
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
        encoded = tokenizer.encode_ordinary_batch(docs, num_threads=os.cpu_count())
        rates["tiktoken"].append((sum(map(len, encoded)) + len(docs)) / (time.perf_counter() - start))
        with tempfile.TemporaryDirectory() as out_dir:
            result = subprocess.run([sys.executable, runs.PREPARE_DATA, "--dataset=demo", f"--out_dir={out_dir}"],
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
    rates, ways = {True: [], False: []}, {True: lambda: list(generate_text(model, prompt, new_tokens, temperature=0)),
                                          False: lambda: greedy_without_cache(model, prompt, new_tokens)}
    if ways[True]() != ways[False]():  # the warm-up: both ways must agree
        raise RuntimeError("generation with the KV cache differs from generation without it")
    for _, use_cache in itertools.product(range(args.repeats), (True, False)):
        start = time.perf_counter()
        rates[use_cache].append(len(ways[use_cache]()) / (time.perf_counter() - start))
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


@torch.no_grad()
def greedy_without_cache(model, prompt, new_tokens):
    """Greedy generation that runs the whole context again for every token: what the KV cache saves."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits = model(torch.tensor([tokens], device=model.head.weight.device))[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def bench_train(args, device):
    """The real training loop (train.py on the demo corpus, tiny preset): tokens/s of each arm,
    runs interleaved. Needs `python prepare_data.py --dataset=demo` first."""
    rates, steps = {e: [] for e in EMBEDDINGS}, 60
    tiny_batch_tokens = read_options(["--size=tiny"]).batch_tokens
    with tempfile.TemporaryDirectory() as tmp:
        for repeat, embedding in itertools.product(range(args.repeats), EMBEDDINGS):
            out_dir, output = os.path.join(tmp, f"{embedding}{repeat}"), os.path.join(tmp, f"{embedding}{repeat}.txt")
            code, _ = runs.wait(runs.start(["--size=tiny", "--data_dir=data/demo", f"--device={device.type}",
                                            f"--embedding={embedding}", f"--total_tokens={steps * tiny_batch_tokens}",
                                            "--eval_interval=1000", f"--out_dir={out_dir}"], output=output))
            if code:
                with open(output) as f:
                    raise UserError(f"train.py failed (exit status {code}): {runs.error_line(f.read())}")
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


# ---------------------------------------------------------------------------- memory: the README's estimates

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
    preset, base = read_options([f"--size={size}"]), size_model(size, embedding="lev")
    m = {(layers, tokens): saved_by_compiled_graph(dataclasses.replace(base, n_layer=layers, seq_len=tokens), tokens)
         for layers in (1, 2) for tokens in (128, 256)}
    d = (m[2, 256] - m[1, 256] - m[2, 128] + m[1, 128]) / 128
    b = m[2, 128] - m[1, 128] - 128 * d
    c = (m[1, 256] - m[1, 128]) / 128 - d
    a = m[1, 128] - b - 128 * c - 128 * d
    layers, tokens, V, D = base.n_layer, preset.micro_batch * base.seq_len, base.vocab_size, base.d_model
    chunk = max(1, min(tokens, LOSS_CHUNK_LOGITS // V))
    # The peak comes with every activation saved: at the end of forward, inside the loss (a chunk's
    # bf16 logits, overwritten by G in the fused step; the bf16 head and a bf16 [V, D] product, counted
    # though a torch with addmm's out_dtype makes none), or at the start of backward (dL/dW scaled,
    # float32 [V, D], and a layer's activation gradients), the larger.
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
        preset = read_options([f"--size={size}"])
        print(f"\n{size}, lev, micro-batch {preset.micro_batch} x {preset.seq_len}, one GPU or DDP (GB)")
        for name, value in parts.items():
            print(f"  {name:<64}{value / 1e9:6.2f}")
        print(f"  {'total (DDP adds nothing: the gradients are its buckets)':<64}{sum(parts.values()) / 1e9:6.2f}"
              f"   (README and experiments.acceptance: {MEMORY_ESTIMATE_GB[size][0]})", flush=True)


SECTIONS = {"model": bench_model, "loss": bench_loss, "data": bench_data, "train": bench_train, "sample": bench_sample,
            "memory": bench_memory}


def bench(argv):
    if argv[:1] == ["gpu"]:  # an alias of `python -m experiments.acceptance`, whose options follow
        start = acceptance.command_start() if __name__ == "__main__" else time.time()
        return acceptance.main(argv[1:], start)
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__,
                                     usage="%(prog)s [SECTION ...] [--name=value]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("sections", nargs="*", help=f"any of: {', '.join(SECTIONS)} (default: all); or gpu alone")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models (and LEV's generator)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="each figure is the median of this many runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        raise UserError(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)} "
                        "(gpu: alone, first)")
    if args.repeats < 1:
        raise UserError(f"--repeats={args.repeats}: must be >= 1 (each figure is a median over repeats)")
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise UserError(f"--device={args.device}: must be cpu, or cuda on a machine with a CUDA GPU")
    device = torch.device(args.device)
    for section in args.sections or SECTIONS:
        SECTIONS[section](args, device)


if __name__ == "__main__":
    sys.exit(run_main(bench, sys.argv[1:]))
