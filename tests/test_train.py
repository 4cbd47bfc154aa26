"""train.py, in its order: the options, the set-up (processes, data, model, resume), the step,
evaluation, the checkpoint, stopping. Each refusal train.py keeps has its test here."""
import errno
import fcntl
import json
import math
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import leviathan
import train
from conftest import (HERE, SCRIPT_ENV, THREADED, TRAIN_ARGS, assert_one_error_line, assert_usage_error, damage,
                      exit_status, logged_losses, prepare_corpus, run_script, train_cli)
from leviathan import EMBEDDINGS, Config, Model
import prepare_data as prep
from test_leviathan import lev_param_formula

STEPS = 24  # the reference run, shared by the resume tests
RUN = [f"--total_tokens={STEPS * 512}", "--eval_interval=1000", "--ckpt_interval=1000"]
EXACT = [*RUN, "--deterministic"]  # run with env=THREADED: bit-identical reruns and resumes


@pytest.fixture(scope="module")
def reference_run(train_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    train_cli(train_data, out, *EXACT, env=THREADED)
    return logged_losses(out)


def set_up(train_data, out, *args):
    """train.py's set-up of a run on train_data into out, in this process."""
    return train.set_up([f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *args])


# ---------------------------------------------------------------------------- the options
def size_model(size, embedding="lev"):
    """A size's model on o200k_base's 200,019 ids, as train.py builds it."""
    config = train.read_options([f"--size={size}", f"--embedding={embedding}"])
    return Config.from_options(config, 200_019)


def test_size_presets_match_the_paper():
    nominal = {"200m": 200e6, "400m": 400e6, "1.2b": 1.2e9}
    with torch.device("meta"):
        for name, target in nominal.items():
            tied = Model(size_model(name, embedding="tied")).param_counts()["total"]
            assert abs(tied / target - 1) < 0.05, (name, tied)
        lev = Model(size_model("1.2b")).param_counts()
        tied = Model(size_model("1.2b", embedding="tied")).param_counts()
    assert size_model("1.2b").d_model == 2048
    assert lev["input"] == lev_param_formula(size_model("1.2b").vocab_size, 2048)
    assert lev["total"] <= 1.0025 * tied["total"]  # the paper: ~0.2% larger
    for name in train.SIZES:
        cfg = size_model(name)
        assert cfg.ffn_dim % 128 == 0 and cfg.ffn_dim >= 8 * cfg.d_model / 3
        assert set(train.LR_SCALES[name]) == set(EMBEDDINGS)


def test_help_shows_the_defaults_of_the_size_and_arm_asked(capsys):
    """`--size=1.2b --help` lists 1.2b's values (and its arm's learning-rate scales), not tiny's."""
    for args, d_model, lr_input in [([], 128, 0.1), (["--size=1.2b", "--embedding=tied"], 2048, 10.0)]:
        assert exit_status(train.main, [*args, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert f"--d_model D_MODEL width D (default {d_model})" in text
        assert f"input table (LR_SCALES: by size and arm) (default {lr_input})" in text


def test_options_are_the_sizes_under_those_given():
    config = train.read_options(["--size=200m", "--embedding=untied", "--lr=1e-3"])
    assert (config.d_model, config.n_layer, config.lr) == (768, 7, 1e-3)
    assert (config.lr_input, config.lr_head) == train.LR_SCALES["200m"]["untied"]
    assert config.out_dir == "out/200m-untied" and config.data_dir == "data/pile"
    assert train.read_options([]).out_dir == "out/tiny-lev"


def test_mistakes_argparse_or_the_model_names_are_theirs(train_data, tmp_path, capsys):
    """Left to argparse (a choice, a number) and to leviathan's Config (a shape), in their own words."""
    for args, phrase in [(["--size=3b"], "argument --size: invalid choice: '3b'"),
                         (["--lr=fast"], "argument --lr: invalid float value: 'fast'"),
                         (["--colour=red"], "unrecognized arguments: --colour=red")]:
        assert_usage_error(exit_status(train.main, args), capsys.readouterr().err, "train.py", phrase)
    code = train.main([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS, "--lev_digits=40"])
    assert_one_error_line(code, capsys.readouterr().err, "lev_digits=40", "fewer than 40 digits")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, phrase", [
    (["--embedding=tied", "--lr_head=10"], "--lr_head must be 1 in the tied arm"),  # S: ignored
    (["--eval_interval=0"], "--eval_interval"),  # H: the loop's first % after the first step
    (["--log_interval=0"], "--log_interval"),
    (["--batch_tokens=500"], "--batch_tokens=500 is not a multiple"),  # S: fewer tokens per step
    (["--seq_len=1_000_000"], "shorter than one window"),  # S: evaluations of nothing
])
def test_options_that_would_train_otherwise_or_fail_late_are_refused_first(train_data, tmp_path, capsys,
                                                                          args, phrase):
    code = train.main([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS, *args])
    assert_one_error_line(code, capsys.readouterr().err, phrase)
    assert not (tmp_path / "o").exists()


def test_wandb_missing_is_one_line_saying_how_to_install_it(train_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train.importlib.util, "find_spec", lambda name: None)
    code = train.main([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS,
                       "--wandb_project=p"])
    assert_one_error_line(code, capsys.readouterr().err, "pip install wandb")
    assert not (tmp_path / "o").exists()


WANDB_STUB = """import json, os
def note(**call):
    with open(os.environ["WANDB_CALLS"], "a") as f:
        f.write(json.dumps(call) + "\\n")
class Run:
    def log(self, data, step):
        note(call="log", step=step)
    def finish(self, exit_code=0):
        note(call="finish", exit_code=exit_code, pid=os.getpid())
def init(**options):
    note(call="init", id=options.get("id"), resume=options.get("resume"), pid=os.getpid())
    return Run()
"""


def test_a_ddp_run_finishes_its_wandb_run_once_and_a_resume_continues_it(train_data, tmp_path):
    """2 gloo ranks with a stand-in for wandb: rank 0 alone opens the W&B run and finishes it once, with the
    run's exit status (a stop, then the end); --resume opens the same W&B run again (its id is kept)."""
    (tmp_path / "stub" / "wandb").mkdir(parents=True)
    (tmp_path / "stub" / "wandb" / "__init__.py").write_text(WANDB_STUB)
    calls = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": f"{tmp_path / 'stub'}{os.pathsep}{HERE}", "WANDB_CALLS": str(calls)}
    run = ["--wandb_project=p", "--total_tokens=4096", "--batch_tokens=1024", "--eval_interval=1000"]
    train_cli(train_data, tmp_path / "o", *run, "--stop_step=2", nproc=2, env=env)
    train_cli(train_data, tmp_path / "o", *run, "--resume", nproc=2, env=env)
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    opened = [c for c in made if c["call"] == "init"]
    assert [c["call"] for c in made if c["call"] != "log"] == ["init", "finish", "init", "finish"], made
    assert opened[0]["id"] and opened[0]["id"] == opened[1]["id"] and opened[0]["resume"] == "allow"
    assert [c["exit_code"] for c in made if c["call"] == "finish"] == [0, 0]
    assert [c["step"] for c in made if c["call"] == "log"][-1] == 4


# ---------------------------------------------------------------------------- the set-up: processes
def test_a_rank_outside_the_world_is_one_line(train_data, tmp_path, monkeypatch, capsys):
    """RANK left over in a shell without torchrun: as rank 1 of 1 the run would train and save nothing."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    code = train.main([f"--data_dir={train_data}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS])
    assert_one_error_line(code, capsys.readouterr().err, "RANK=1", "WORLD_SIZE=1", "torchrun")
    assert not (tmp_path / "o").exists()


def test_a_stale_torchrun_environment_says_what_it_waits_for(train_data, tmp_path):
    """torchrun's variables left in a shell (RANK=0, WORLD_SIZE=2, MASTER_*): a plain `python train.py` waits
    for the other rank, and says so in its first line instead of waiting in silence."""
    stale = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29431")
    proc = subprocess.Popen([sys.executable, "train.py", f"--data_dir={train_data}", f"--out_dir={tmp_path / 'o'}",
                             *TRAIN_ARGS], cwd=HERE, env={**SCRIPT_ENV, **stale}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # else it would wait for its 20-min timeout
        assert ready and proc.stdout.readline() == "waiting for 2 ranks at 127.0.0.1:29431\n"
    finally:
        proc.kill()
        proc.wait()


def start_rank(rank, port, data_dir, out_dir, *args, checkout=HERE):
    """train.py as rank `rank` of 2 on this machine, as a node of its own starts it (torchrun's variables)."""
    env = dict(SCRIPT_ENV, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(checkout))
    return subprocess.Popen([sys.executable, "train.py", f"--data_dir={data_dir}", f"--out_dir={out_dir}",
                             *TRAIN_ARGS, "--total_tokens=2048", *args], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("case", ["lr", "data", "code"])
def test_ranks_that_disagree_are_refused_by_every_rank_before_any_step(train_data, tmp_path, case):
    """Two nodes' ranks: rank 1 started with another --lr, another data folder, or from another checkout (its
    leviathan.py changed), is named with the option by every rank before any step (else both train on, exit
    0). Nothing is trained or saved."""
    other = tmp_path / "other"
    shutil.copytree(train_data, other)
    shard = prep.shard_paths(other, "train")[0]
    prep.write_shard(shard, prep.read_shard(shard)[:][::-1], 512)  # the same tokens, in another order
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("train.py", "leviathan.py", "prepare_data.py"):
        shutil.copy(os.path.join(HERE, name), checkout / name)
    with open(checkout / "leviathan.py", "a") as f:
        f.write("EPS = 1e-5  # another checkout's line\n")
    rank1 = {"lr": (train_data, "--lr=1e-3"), "data": (other,), "code": (train_data,)}[case]
    port = 29500 + os.getpid() % 400
    procs = [start_rank(0, port, train_data, tmp_path / "o"),
             start_rank(1, port, rank1[0], tmp_path / "o", *rank1[1:], checkout=checkout if case == "code" else HERE)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    errors = [[line for line in err.splitlines() if line.startswith("error:")] for _, err in outputs]
    assert [proc.returncode for proc in procs] == [1, 1] and all(len(e) == 1 for e in errors), outputs
    assert errors[0] == errors[1] and f"rank 1 differs from rank 0 in {case}: start every rank alike" in errors[0][0]
    assert not (tmp_path / "o" / "ckpt.pt").exists() and not (tmp_path / "o" / "log.jsonl").exists()


def test_a_set_up_error_on_one_rank_stops_every_rank(train_data, tmp_path):
    """Rank 1 cannot find its data after the process group is up (a folder missing on one node): it says why in
    one line and exits; torchrun stops rank 0, which waits for it in the set-up's collective, and names rank 1."""
    rank_data = f'[ "$RANK" = 1 ] && echo {tmp_path / "missing"} || echo {train_data}'
    script = (f'exec {sys.executable} train.py --data_dir=$({rank_data}) --out_dir={tmp_path / "o"} '
              + " ".join(TRAIN_ARGS))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--no-python", "sh", "-c", script], cwd=HERE, env=SCRIPT_ENV, capture_output=True, text=True,
                       timeout=120)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error: ")]
    assert r.returncode != 0 and len(errors) == 1 and "No such file or directory" in errors[0], r.stderr
    root_cause = r.stderr[r.stderr.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*1\b", root_cause), r.stderr
    assert not list((tmp_path / "o").glob("*"))  # rank 0 may have made the folder, and wrote nothing


def test_two_process_ddp_matches_one_process_with_accumulation(train_data, tmp_path):
    # 1 process: 4 micro-steps of 8 sequences; 2 processes: 2 micro-steps each (DDP's no_sync
    # path), gradients in DDP's buckets (gradient_as_bucket_view). Same global batch.
    batch = ["--total_tokens=8192", "--batch_tokens=1024"]
    train_cli(train_data, tmp_path / "one", *batch)
    r = train_cli(train_data, tmp_path / "two", *batch, nproc=2)
    assert "2 x cpu, 2 micro-steps" in r.stdout
    one, two = logged_losses(tmp_path / "one"), logged_losses(tmp_path / "two")
    assert len(one) == len(two) == 8
    for step in one:
        assert two[step][0] == pytest.approx(one[step][0], abs=1e-5), step
    ev1 = json.load(open(tmp_path / "one" / "eval_step8.json"))
    ev2 = json.load(open(tmp_path / "two" / "eval_step8.json"))  # eval split over 2 ranks, reduced
    assert ev2["eval_tokens"] == ev1["eval_tokens"]
    assert ev2["val_loss"] == pytest.approx(ev1["val_loss"], abs=1e-5)


def test_batch_that_does_not_divide_over_the_world_size(train_data, tmp_path):
    r = train_cli(train_data, tmp_path / "o", "--batch_tokens=256", nproc=2, check=False)  # 256 = 1 x 8 x 32 only
    assert r.returncode != 0  # each rank meets it, and says it in one line
    assert {line for line in r.stderr.splitlines() if line.startswith("error:")} == {
        "error: --batch_tokens=256 is not a multiple of world size 2 x micro_batch 8 x seq_len 32"}


# ---------------------------------------------------------------------------- the set-up: data
def test_every_training_window_once_per_epoch(tmp_path):
    shards = []
    for i, (start, n) in enumerate([(0, 41), (1000, 10), (2000, 33), (3000, 5)]):
        prep.write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(start, start + n), vocab_size=4000)
        shards.append(prep.read_shard(tmp_path / f"train_{i:06d}.bin"))
    windows = train.Windows(shards, seq_len=4, seed=7)
    assert windows.total == 10 + 2 + 8 + 1  # (n - 1) // seq_len windows per shard
    expected = sorted((s[:1][0] // 1000, i) for s in shards for i in range(0, (len(s) - 1) // 4 * 4, 4))
    epochs = []
    for epoch in range(2):
        got = [windows[epoch * windows.total + p] for p in range(windows.total)]
        assert all(len(w) == 5 and np.array_equal(w, np.arange(w[0], w[0] + 5)) for w in got)
        assert sorted((w[0] // 1000, w[0] % 1000) for w in got) == expected
        epochs.append([int(w[0]) for w in got])
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # shuffled, anew each epoch
    again = train.Windows(shards, seq_len=4, seed=7)
    assert [int(again[p][0]) for p in range(windows.total)] == epochs[0]  # deterministic


def test_missing_data_is_the_os_errors_one_line(tmp_path, capsys):
    code = train.main([f"--data_dir={tmp_path / 'nowhere'}", f"--out_dir={tmp_path / 'o'}", "--device=cpu"])
    assert_one_error_line(code, capsys.readouterr().err, "No such file or directory", "nowhere")
    assert not (tmp_path / "o").exists()


def test_a_data_folder_of_more_shards_than_open_files_allowed(train_data, tmp_path):
    """No file stays open per shard: a folder of more shards than `ulimit -n` (here 64) trains."""
    data = tmp_path / "data"
    r = run_script("prepare_data.py", f"--dataset={train_data.parent / 'corpus.jsonl'}", f"--out_dir={data}",
                   "--vocab_size=512", "--val_fraction=0.1", "--workers=1", "--shard_tokens=1000")
    assert r.returncode == 0 and len(list(data.glob("*.bin"))) > 64, r.stderr
    cmd = [sys.executable, "train.py", f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", *TRAIN_ARGS,
           "--total_tokens=1024"]
    r = subprocess.run(cmd, cwd=HERE, env=SCRIPT_ENV, capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    assert r.returncode == 0, r.stderr


def test_shards_of_another_tokenizer_or_a_partial_copy_are_refused(train_data, tmp_path, capsys):
    """Shards that meta.json does not describe would be read as other text: another vocabulary (here the
    meta.json of a 1024-id tokenizer), or a shard rewritten with other tokens than it lists."""
    bad = tmp_path / "data"
    shutil.copytree(train_data, bad)
    meta = json.loads((bad / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "vocab_size": 1024}))
    code = train.main([f"--data_dir={bad}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS])
    assert_one_error_line(code, capsys.readouterr().err, "not a whole shard of this data")
    meta["splits"]["train"]["tokens"] += 1
    (bad / "meta.json").write_text(json.dumps(meta))
    code = train.main([f"--data_dir={bad}", f"--out_dir={tmp_path / 'o'}", *TRAIN_ARGS])
    assert_one_error_line(code, capsys.readouterr().err, "other train shards than its meta.json lists")
    assert not (tmp_path / "o").exists()


def test_data_changed_under_a_run_is_refused_on_resume(train_data, tmp_path, capsys):
    """A resume on a data folder prepared again with other settings is one line, and the run is left as
    it was: it would go on over other windows than its first steps'."""
    out, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(train_data, data)
    train_cli(data, out, "--total_tokens=2048", "--stop_step=2")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    again = tmp_path / "again"  # the same corpus prepared again with other settings: other shards
    r = run_script("prepare_data.py", f"--dataset={train_data.parent / 'corpus.jsonl'}", f"--out_dir={again}",
                   "--vocab_size=512", "--val_fraction=0.2", "--workers=1")
    assert r.returncode == 0, r.stderr
    shutil.copytree(again, data, dirs_exist_ok=True)
    code = train.main([f"--data_dir={data}", f"--out_dir={out}", *TRAIN_ARGS, "--total_tokens=2048", "--resume"])
    assert_one_error_line(code, capsys.readouterr().err, "changed since", "another --out_dir")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


# ---------------------------------------------------------------------------- the set-up: model
def test_compiled_bf16_training_on_cpu_and_eager_resume(train_data, tmp_path, reference_run):
    """The CUDA code path (inductor-compiled model and LEV generator, bf16 autocast, the chunked
    loss under autocast) run on the CPU; its checkpoint then resumes in eager float32."""
    out = tmp_path / "run"
    train_cli(train_data, out, *RUN, "--compile", "--bf16", "--stop_step=3")
    compiled = logged_losses(out)
    assert compiled[1][0] == pytest.approx(math.log(512), abs=0.05)  # zero-initialised head
    for step in (1, 2, 3):  # bf16 rounding only: the same training as the float32 run
        assert compiled[step][0] == pytest.approx(reference_run[step][0], abs=0.03), step
    train_cli(train_data, out, *RUN, "--resume")
    resumed = logged_losses(out)
    assert len(resumed) == STEPS and resumed[STEPS][0] == pytest.approx(reference_run[STEPS][0], abs=0.05)


DDP_PROBE = """
import functools, json, os, sys, torch
from torch._dynamo.utils import counters
import leviathan, train
# a quick compiler: how often a graph is compiled under DDP is TorchDynamo's affair, whatever the backend
leviathan.Model.compile = functools.partialmethod(leviathan.Model.compile, backend="aot_eager")
torch.nn.parallel.DistributedDataParallel = functools.partial(torch.nn.parallel.DistributedDataParallel,
                                                            bucket_cap_mb=1)  # the smallest the DDP optimizer takes
run = train.set_up(sys.argv[1:])
steps = []  # (loss, gradient norm) of each step
for run.step in range(2):  # DDP makes the gradients views into its buckets at the second forward
    steps.append(train.train_step(run)[:2])
params = [p for p in run.raw_model.parameters() if p.requires_grad]
buckets = [None if p.grad is None else p.grad.untyped_storage().data_ptr() for p in params]
seen = []  # whether each accumulation of the third step, micro-steps included, lands in a bucket
for i, p in enumerate(params):
    p.register_post_accumulate_grad_hook(lambda p, i=i: seen.append(p.grad.untyped_storage().data_ptr() == buckets[i]))
run.step = 2
steps.append(train.train_step(run)[:2])
report = dict(graphs=counters["aot_autograd"]["total"], params=len(params), buckets=len(set(buckets)),
              accumulations=len(seen), in_buckets=sum(seen), steps=steps)
with open(os.path.join(run.config.out_dir, f"probe{run.rank}.json"), "w") as f:
    json.dump(report, f)
train.shut_down(run, 0)
"""


def test_compiled_ddp_runs_one_graph_for_every_block_and_matches_one_process(train_data, tmp_path):
    """Compiled in place block by block and then wrapped (build's order): the graph compiled for the
    first block serves the other three, inside DDP's forward as on one process, and 2 ranks train as
    one process does (the same losses and gradient norms over 3 steps). Under accumulation the
    gradients stay views into DDP's buckets, so no micro-step makes a second copy of them."""
    probe = tmp_path / "probe.py"
    probe.write_text(DDP_PROBE)
    reports = {}
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    for processes, launcher in ((1, []), (2, torchrun)):
        out = tmp_path / f"run{processes}"
        r = run_script(probe, f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS,
                       "--embedding=tied", "--d_model=128", "--n_layer=4", "--compile", "--batch_tokens=1024",
                       "--total_tokens=4096",  # 3.4 MB of weights: 2 buckets or more
                       launcher=launcher)
        assert r.returncode == 0, r.stdout + r.stderr
        reports[processes] = [json.loads((out / f"probe{rank}.json").read_text())
                              for rank in range(processes)]
    for report in reports[1] + reports[2]:
        assert report["graphs"] == 1, report  # one block's graph, compiled once for all four
        assert np.ravel(report["steps"]) == pytest.approx(np.ravel(reports[1][0]["steps"]), abs=1e-5), report
    for report in reports[2]:
        assert report["params"] == 26 and 1 < report["buckets"] < 26, report  # gradients are bucket views
        assert report["accumulations"] == 2 * 26 and report["in_buckets"] == 2 * 26, report  # 2 micro-steps


# ---------------------------------------------------------------------------- the step
def test_accumulated_micro_batch_gradients_equal_one_full_batchs(train_data, tmp_path):
    """4 micro-batches of 8 windows, their gradients accumulated, against one batch of the same 32 windows:
    the same gradients, compared before any optimizer step (AdamW would hide a constant scale)."""
    results = []
    for micro_batch in (8, 32):
        run = set_up(train_data, tmp_path / f"micro{micro_batch}", *RUN, "--batch_tokens=1024",
                     f"--micro_batch={micro_batch}")
        run.lock.close()
        loss = train.accumulate_gradients(run) / run.accum
        results.append((run.accum, loss, [p.grad for p in run.raw_model.parameters()]))
    (accum, loss, grads), (whole_accum, whole_loss, whole_grads) = results
    assert (accum, whole_accum) == (4, 1)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=0)
    for grad, whole in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(grad, whole, rtol=1e-5, atol=1e-8)


def test_training_finds_lev_distinct_ids_with_the_batch_not_in_the_model(train_data, tmp_path):
    """LEV's torch.unique runs in to_batch, where the batch starts on the CPU, not in the model's
    forward, where on a GPU the host would wait for the device to know their number: a step's
    micro-steps run no unique op inside the model, and hand it the inputs' distinct_ids."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class UniqueOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "unique" in func.__name__:
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    run = set_up(train_data, tmp_path / "run", *RUN)
    run.lock.close()
    assert run.config.embedding == "lev" and run.accum == 2
    calls, forward = [], run.model.forward

    def watched_forward(x, y, distinct=None, **kwargs):
        rows, inverse = leviathan.distinct_ids(x)
        assert torch.equal(distinct[0], rows) and torch.equal(distinct[1], inverse)
        with UniqueOps() as census:
            loss = forward(x, y, distinct=distinct, **kwargs)
        calls.append(census.ops)
        return loss

    run.model.forward = watched_forward
    train.train_step(run)
    assert calls == [[], []]


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(train_data, tmp_path):
    out = tmp_path / "run"
    r = train_cli(train_data, out, "--total_tokens=5120", "--lr=1e30", "--warmup_steps=1", "--ckpt_interval=1",
                  "--embedding=untied", check=False)
    assert r.returncode == 1 and "non-finite loss" in r.stderr and "Traceback" not in r.stderr
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert step == max(logged_losses(out)) < 10


# ---------------------------------------------------------------------------- evaluation
def test_loss_decreases_and_eval_is_written(train_data, tmp_path):
    out = tmp_path / "run"
    r = train_cli(train_data, out, "--total_tokens=30720", "--eval_interval=30", "--lr=1e-2", "--warmup_steps=10")
    curve = logged_losses(out)
    assert len(curve) == 60 and "TFLOP/s" not in r.stdout  # CPU: no MFU
    first, last = curve[1][0], np.mean([curve[s][0] for s in range(56, 61)])
    assert first == pytest.approx(math.log(512), abs=0.05)  # zero-initialised head: uniform prediction
    assert last < first - 2.5, (first, last)
    result = json.load(open(out / "eval_step60.json"))
    assert result["val_loss"] < first - 2.5 and result["val_ppl"] == pytest.approx(math.exp(result["val_loss"]))
    assert result["eval_tokens"] == 2048 and sum(b["tokens"] for b in result["buckets"]) == 2048
    assert 0 < result["val_bpb"] < result["val_loss"] / math.log(2)  # tokens are >= 1 byte each
    config = json.load(open(out / "config.json"))
    assert config["train"]["d_model"] == config["model"]["d_model"] == 32 and config["model"]["vocab_size"] == 512


def frequency_table(losses, target_counts, n_buckets):
    """Validation perplexity per bucket of the target's training count, as train.evaluate builds it."""
    return train.bucket_table(*train.bucket_sums(losses, target_counts, n_buckets))


def test_frequency_table_matches_hand_computed_buckets():
    losses_ = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5]
    counts = [0, 1, 9, 10, 999, 0, 1000]
    rows = frequency_table(losses_, counts, 5)
    assert [r["counts"] for r in rows] == ["0", "1-9", "10-99", "100-999", "1000-9999"]
    assert [r["tokens"] for r in rows] == [2, 2, 1, 1, 1]
    # bucket 0: (1 + 6) / 2; 1-9: (2 + 3) / 2; 10-99: 4; 100-999: 5; 1000-9999: 0.5
    assert [r["loss"] for r in rows] == pytest.approx([3.5, 2.5, 4.0, 5.0, 0.5])
    assert [r["ppl"] for r in rows] == pytest.approx([math.exp(x) for x in (3.5, 2.5, 4.0, 5.0, 0.5)])
    empty = frequency_table([2.0], [0], 3)
    assert empty[1]["tokens"] == 0 and empty[1]["loss"] is None and empty[2]["ppl"] is None
    # sums from two halves add up to the whole: what the all_reduce over ranks relies on
    a, b = train.bucket_sums(losses_[:3], counts[:3], 5), train.bucket_sums(losses_[3:], counts[3:], 5)
    assert train.bucket_table(a[0] + b[0], a[1] + b[1]) == rows


def test_an_uneven_last_eval_batch_is_padded_to_the_same_shape(train_data, tmp_path):
    """10 validation windows in batches of 8: the last 2 are padded to 8 (a compiled model would
    otherwise compile again for the new shape), and the padding's losses are not counted."""
    run = set_up(train_data, tmp_path / "run", *RUN, "--eval_tokens=320")
    run.lock.close()
    shapes, forward = [], run.raw_model.forward
    run.raw_model.forward = lambda x, y, **kw: shapes.append(tuple(x.shape)) or forward(x, y, **kw)
    result = train.evaluate(run)
    assert shapes == [(8, 32), (8, 32)] and result["eval_tokens"] == 10 * 32
    x, y, distinct = train.to_batch(run.val, run.device, lev=True)
    with torch.no_grad():
        assert result["val_loss"] == pytest.approx(forward(x, y, distinct=distinct).item(), abs=1e-5)


def test_eval_only_on_other_data_or_tokens_is_written_apart_from_every_other_result(train_data, tmp_path):
    """--eval_only on a data folder the run did not train on (another validation set), or with other
    --eval_tokens, writes into <run>/eval-<folder>-<key>/ (its eval_step<N>.json and log), keyed by what made
    it: the run's own evaluation and log stay as they were, and so does an earlier result on data that the
    same folder name held then."""
    out, other = tmp_path / "run", tmp_path / "heldout"
    train_cli(train_data, out, "--total_tokens=2048")
    before = {name: (out / name).read_bytes() for name in ("eval_step4.json", "log.jsonl")}
    shutil.copytree(train_data, other)
    val = prep.shard_paths(other, "val")[0]
    tokens = prep.read_shard(val)[:]
    results = {}
    for text in (tokens[::-1], np.roll(tokens, 7)):  # other validation text, the same tokenizer, twice
        prep.write_shard(val, text, 512)
        r = train_cli(other, out, "--total_tokens=2048", "--eval_only")
        folder = next(out / name for name in os.listdir(out)
                      if name.startswith("eval-heldout-") and out / name not in results)
        results[folder] = (folder / "eval_step4.json").read_bytes()
        assert f"val loss {json.loads(results[folder])['val_loss']:.4f}" in r.stdout
        assert "eval" in (folder / "log.jsonl").read_text()
    r = train_cli(train_data, out, "--total_tokens=2048", "--eval_only", "--eval_tokens=1024")  # fewer tokens
    folder = next(out / name for name in os.listdir(out) if name.startswith(f"eval-{train_data.name}-"))
    assert json.loads((folder / "eval_step4.json").read_text())["eval_tokens"] == 1024
    assert len(results) == 2
    for earlier, kept in results.items():
        assert (earlier / "eval_step4.json").read_bytes() == kept
    assert {name: (out / name).read_bytes() for name in before} == before
    train_cli(train_data, out, "--total_tokens=2048", "--eval_only")  # its own data: its own file, logged
    assert (out / "log.jsonl").read_text().count('"type": "eval"') == 2


def test_a_run_killed_in_its_final_evaluation_evaluates_when_resumed(train_data, tmp_path):
    """A run killed during its last evaluation has its last checkpoint but not that evaluation: --resume
    trains no step and evaluates, so that the run is whole (and a compare tables a final evaluation)."""
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=2048", "--eval_interval=2")
    final = out / "eval_step4.json"
    expected = json.loads(final.read_text())
    final.unlink()  # as a kill during the final evaluation leaves the run
    log = (out / "log.jsonl").read_text().splitlines(keepends=True)
    (out / "log.jsonl").write_text("".join(log[:-1]))
    assert json.loads(log[-1])["type"] == "eval" and json.loads(log[-2])["step"] == 4
    r = train_cli(train_data, out, "--total_tokens=2048", "--eval_interval=2", "--resume")
    assert "eval step 4:" in r.stdout and "step 5" not in r.stdout
    assert json.loads(final.read_text()) == expected
    assert (out / "log.jsonl").read_text() == "".join(log)


def test_a_run_preempted_or_killed_before_an_evaluation_makes_it_when_resumed(train_data, tmp_path):
    """The evaluation due at the step a run stopped at, missing (a preemption skips it; a kill cut it short), is
    made first on --resume, with its log record, before training goes on."""
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=4096", "--eval_interval=2", "--stop_step=2")
    (out / "eval_step2.json").unlink()
    log = (out / "log.jsonl").read_text().splitlines(keepends=True)
    (out / "log.jsonl").write_text("".join(r for r in log if json.loads(r)["type"] != "eval"))
    r = train_cli(train_data, out, "--total_tokens=4096", "--eval_interval=2", "--log_interval=1", "--resume")
    assert r.stdout.index("eval step 2:") < r.stdout.index("step 3/8")
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["type"] == "eval"] == [2, 4, 6, 8] and (out / "eval_step2.json").exists()


def test_a_requeued_job_at_its_stop_step_trains_nothing(train_data, tmp_path):
    """--stop_step S asked again of a run at step S or past it (a requeued job, the same command): it exits 0
    without a step, its checkpoint and log untouched, where it would otherwise train on to the end."""
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=4096", "--stop_step=2")
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "log.jsonl")}
    for stop in (2, 1):
        r = train_cli(train_data, out, "--total_tokens=4096", f"--stop_step={stop}", "--resume")
        assert f"step 2: --stop_step={stop} reached; nothing to train" in r.stdout
    assert {name: (out / name).read_bytes() for name in before} == before


# ---------------------------------------------------------------------------- checkpoint and resume
def test_checkpoint_loads_with_weights_only(train_data, tmp_path):
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=1024", "--embedding=tied")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt.keys() == {"model", "optimizer", "model_config", "train_config", "step", "tokens_seen", "data_meta",
                           "data", "wandb_id"}
    assert {len(shards) for shards in ckpt["data"].values()} == {1}  # each split's one shard: tokens, checksum
    assert ckpt["step"] == 2 and ckpt["tokens_seen"] == 1024
    model = Model(Config(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])  # the uncompiled model's keys
    assert ckpt["data_meta"] == json.load(open(train_data / "meta.json"))
    assert not os.path.exists(out / "ckpt.pt.tmp")
    head, table = ckpt["model"]["head.weight"], ckpt["model"]["embed.weight"]  # the tied table: held once
    assert head.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()


# A full disk as torch.save reports it: an OSError from the file, or a RuntimeError from its zip writer.
@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter "
                                                "failed writing file data/0: file write failed")])
def test_full_disk_during_a_checkpoint_keeps_the_previous_one(train_data, tmp_path, monkeypatch, error):
    run = set_up(train_data, tmp_path / "run", *RUN)
    run.lock.close()
    run.step = 1
    train.checkpoint(run)
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()

    def save_until_the_disk_is_full(obj, f):
        f.write(b"half a checkpoint")
        raise error
    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    run.step = 2
    with pytest.raises(type(error)):
        train.checkpoint(run)
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == good and not (tmp_path / "run" / "ckpt.pt.tmp").exists()


def test_a_checkpoint_due_with_an_evaluation_is_saved_before_it(train_data, tmp_path):
    """The save first: a preemption during the evaluation (on a GPU, its first compile takes minutes)
    loses no step."""
    r = train_cli(train_data, tmp_path / "run", "--total_tokens=2048", "--eval_interval=2",
                  "--ckpt_interval=2")
    assert r.stdout.index("checkpoint: step 2,") < r.stdout.index("eval step 2:"), r.stdout


def test_a_log_line_cut_by_a_kill_is_dropped_on_resume(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "train", "step": 1}\n{"type": "train", "step": 2}\n{"type": "tr')
    train.keep_log_until(str(log), 2)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2]


def test_deterministic_resume_reproduces_the_uninterrupted_run_exactly(train_data, tmp_path, reference_run):
    out = tmp_path / "run"
    r = train_cli(train_data, out, *EXACT, "--stop_step=10", env=THREADED)
    assert "stopped at step 10" in r.stdout and max(logged_losses(out)) == 10
    train_cli(train_data, out, *RUN, "--resume", env=THREADED)  # --deterministic: the checkpoint's
    assert logged_losses(out) == reference_run  # every step's loss and lr, bit for bit


def test_a_deterministic_run_resumes_deterministic_without_the_flag(train_data, tmp_path):
    """The checkpoint's options are in force before the device is set up: a --resume of a --deterministic
    run sets deterministic algorithms (on CUDA, cuBLAS's fixed workspace too) without the flag again."""
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=2048", "--deterministic", "--stop_step=1")
    torch.use_deterministic_algorithms(False)
    try:
        run = set_up(train_data, out, "--total_tokens=2048", "--resume")
        run.lock.close()
        assert run.config.deterministic and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_resume_without_deterministic_agrees_within_tolerance(train_data, tmp_path, reference_run):
    """The README's promise without --deterministic: a rerun or resume on the same machine agrees
    with the uninterrupted run to 1e-4 in every logged loss (kernels may sum in another order)."""
    out = tmp_path / "run"
    train_cli(train_data, out, *RUN, "--stop_step=10", env=THREADED)
    train_cli(train_data, out, *RUN, "--resume", env=THREADED)
    resumed = logged_losses(out)
    assert resumed.keys() == reference_run.keys()
    for step, (loss, lr) in reference_run.items():
        assert resumed[step][0] == pytest.approx(loss, abs=1e-4) and resumed[step][1] == lr, step


# A storage location this machine does not have, as a GPU's checkpoint is on a CPU-only machine
# (or cuda:0's on the rank that owns cuda:1). Tagged only while SAVED_ELSEWHERE is set.
SAVED_ELSEWHERE = {"on": False}


def _no_such_device(storage, location):
    if location == "elsewhere":
        raise RuntimeError("this checkpoint was saved on a device this machine does not have")


torch.serialization.register_package(0, lambda storage: "elsewhere" if SAVED_ELSEWHERE["on"] else None, _no_such_device)


def test_checkpoint_saved_on_another_device_resumes_exactly(train_data, tmp_path, reference_run):
    out = tmp_path / "run"
    train_cli(train_data, out, *EXACT, "--stop_step=10", env=THREADED)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    SAVED_ELSEWHERE["on"] = True
    try:
        torch.save(ckpt, out / "ckpt.pt")
    finally:
        SAVED_ELSEWHERE["on"] = False
    with pytest.raises(RuntimeError, match="does not have"):  # what loading it where it was saved does
        torch.load(out / "ckpt.pt", weights_only=True)
    train_cli(train_data, out, *EXACT, "--resume", env=THREADED)
    assert logged_losses(out) == reference_run


def test_a_new_run_never_starts_over_another_runs_files(train_data, tmp_path, capsys):
    """The rule that protects ckpt.pt protects the files a run writes: a folder holding a log or a config
    of another run (no checkpoint) is refused, and left as it was."""
    for name in ("log.jsonl", "config.json", "ckpt.pt"):
        out = tmp_path / name
        out.mkdir()
        (out / name).write_text("{}\n")
        code = train.main([f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS])
        assert_one_error_line(code, capsys.readouterr().err, "holds another run", "--resume", "another --out_dir")
        assert os.listdir(out) == [name] and (out / name).read_text() == "{}\n"


def test_a_run_without_room_for_its_checkpoint_is_refused_before_training(train_data, tmp_path, monkeypatch):
    """A folder whose disk cannot hold one more checkpoint (12 bytes a parameter: weights and AdamW's moments)
    is refused before a step or a file of the run, not at the first save."""
    probe = set_up(train_data, tmp_path / "probe")
    probe.lock.close()
    params, out = probe.raw_model.param_counts()["total"], tmp_path / "run"
    real = shutil.disk_usage
    for free, refused in ((12 * params - 1, True), (12 * params, False)):
        monkeypatch.setattr(train.shutil, "disk_usage", lambda path: real(path)._replace(free=free))
        if refused:
            with pytest.raises(prep.UserError, match="less than the .* GB a checkpoint needs"):
                set_up(train_data, out)
            assert os.listdir(out) == [".lock"]
        else:
            set_up(train_data, out).lock.close()


def test_a_damaged_checkpoint_is_refused_before_a_resume_or_an_evaluation(train_data, tmp_path, capsys):
    """A bit flipped in ckpt.pt (a disk, a copy): torch.load checks no CRC-32 and would go on from other
    weights; --resume and --eval_only refuse it in one line, the run's files as they were."""
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=1024")
    damage(out / "ckpt.pt")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    for flag in ("--resume", "--eval_only"):
        code = train.main([f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, "--total_tokens=2048", flag])
        assert_one_error_line(code, capsys.readouterr().err, "ckpt.pt is damaged", "fails its CRC-32")
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_checkpoint_mismatches_leave_the_run_untouched(train_data, tmp_path, capsys):
    """A resume with options that change the loss curve, or on another tokenizer's data, is refused before
    anything is written; a resume with no checkpoint is the OS's one line."""
    out = tmp_path / "run"
    train_cli(train_data, out, "--total_tokens=1024")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    other = prepare_corpus(tmp_path, "other", 700)  # another tokenizer: 700 ids, padded to 768
    for data_dir, run, args, phrases in [
            (train_data, out, ["--resume", "--d_model=64"], ["trained with other d_model", "another --out_dir"]),
            (train_data, out, ["--eval_only", "--lr=1"], ["trained with other lr"]),
            (other, out, ["--resume"], ["another tokenizer"]),
            (other, out, ["--eval_only"], ["another tokenizer"]),
            (train_data, tmp_path / "none", ["--resume"], ["No such file or directory", "ckpt.pt"])]:
        code = train.main([f"--data_dir={data_dir}", f"--out_dir={run}", *TRAIN_ARGS, "--total_tokens=1024", *args])
        assert_one_error_line(code, capsys.readouterr().err, *phrases)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_a_checkpoint_with_an_option_this_train_py_lacks(train_data, tmp_path, capsys):
    """An option a checkpoint's train.py had and this one lacks (a newer train.py's): set, it
    shaped the run, so a resume is one error line naming it; left unset (false, 0 or empty), it changed
    nothing and the resume goes on."""
    out = tmp_path / "run"
    args = [f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, "--total_tokens=1024"]
    assert train.main([*args, "--stop_step=1"]) == 0
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["train_config"]["retired_option"] = 4
    torch.save(ckpt, out / "ckpt.pt")
    assert train.main([*args, "--resume"]) == 1
    assert_one_error_line(1, capsys.readouterr().err, "retired_option, which this train.py lacks")
    ckpt["train_config"]["retired_option"] = ""
    torch.save(ckpt, out / "ckpt.pt")
    assert train.main([*args, "--resume"]) == 0


def test_a_run_folder_in_use_is_refused_and_let_go_at_any_death(train_data, tmp_path, capsys):
    """One process per run folder: a second --resume of a run still training is one line naming the folder
    and its holder, and writes nothing there; a kill -9 of the holder lets the folder go (the OS drops the
    flock), and the same --resume then goes on from the last checkpoint."""
    out = tmp_path / "run"
    slow_steps = ["--batch_tokens=131072", "--total_tokens=1310720", "--ckpt_interval=1"]  # 512 micro-steps each
    args = [f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *slow_steps]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=HERE, env=SCRIPT_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert any(line.startswith("checkpoint: step 1") for line in iter(proc.stdout.readline, ""))
        log = (out / "log.jsonl").read_text()
        code = train.main([*args, "--resume"])
        assert_one_error_line(code, capsys.readouterr().err, f"{out} is in use by process {proc.pid} on ",
                              "wait for it")
        assert (out / "log.jsonl").read_text().startswith(log) and proc.poll() is None  # untouched, still training
    finally:
        proc.kill()
        proc.wait()
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert train.main([*args, "--resume", f"--stop_step={step + 1}"]) == 0
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == step + 1


# ---------------------------------------------------------------------------- stopping
def worker_pid(launcher_pid, rank):
    """The pid of torchrun's worker of this rank (from /proc), or None while it has not started."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def test_a_signal_on_one_rank_stops_every_rank_alike(train_data, tmp_path):
    """SIGTERM that reaches rank 1 only (a node's own preemption): both ranks save at the same step and exit
    128 + SIGTERM, so torchrun reports one cause, and rank 0, which prints, names the signal."""
    if not os.path.exists("/proc/self/environ"):
        pytest.skip("needs /proc to find torchrun's workers")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             "train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *RUN],
                            cwd=HERE, env=SCRIPT_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not ((out / "log.jsonl").exists() and (out / "log.jsonl").read_text()) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(worker_pid(proc.pid, 1), signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    statuses = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", output))
    assert statuses == {"0": "143", "1": "143"}, output
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert f"stopped at step {step} (SIGTERM)" in output and max(logged_losses(out)) == step, output


def signals_as_in_a_terminal():
    """In the child: SIGHUP and SIGINT reach it, as in a terminal, even where the tests run under nohup or as
    a shell script's background job (`bash .ci/run &`), which start it with them ignored (and the run would
    rightly leave them so)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# SIGUSR1: SLURM's --signal; SIGHUP: the terminal closed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP])
def test_preemption_signal_saves_a_resumable_checkpoint(train_data, tmp_path, reference_run, signum):
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *EXACT]
    proc = subprocess.Popen(cmd, cwd=HERE, env={**SCRIPT_ENV, **THREADED}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=signals_as_in_a_terminal)
    log = out / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stdout + stderr
    assert signal.Signals(signum).name in stdout and "Traceback" not in stderr
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 1 <= step < STEPS and max(logged_losses(out)) == step
    train_cli(train_data, out, *EXACT, "--resume", env=THREADED)
    assert logged_losses(out) == reference_run


def test_closing_the_terminal_saves_a_resumable_checkpoint(train_data, tmp_path, reference_run):
    """The terminal closed: the kernel sends SIGHUP to the run (here the leader of the terminal's session),
    whose writes to it fail from then on (EIO); it stops as at any preemption, saved, status 128 + SIGHUP."""
    out, (master, terminal) = tmp_path / "run", os.openpty()
    cmd = [sys.executable, "train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *EXACT]
    proc = subprocess.Popen(cmd, cwd=HERE, env={**SCRIPT_ENV, **THREADED}, stdin=terminal, stdout=terminal,
                            stderr=terminal, start_new_session=True,  # its own session, the pty its terminal
                            preexec_fn=lambda: signals_as_in_a_terminal() or fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(terminal)  # left unread: the run's output (~3 KB) fits the terminal's buffer
    log = out / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.close(master)
    assert proc.wait(timeout=60) == 128 + signal.SIGHUP
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 1 <= step < STEPS and max(logged_losses(out)) == step
    train_cli(train_data, out, *EXACT, "--resume", env=THREADED)
    assert logged_losses(out) == reference_run


def test_signals_ignored_at_start_stay_ignored(train_data, tmp_path):
    """`nohup train.py &` ignores SIGHUP, and a shell script's background job SIGINT: the run leaves them
    ignored, so that logging out (or a Ctrl-C meant for the script) does not stop it."""
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *RUN]
    def as_nohup_and_a_background_job():  # in the child, before train.py starts
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc = subprocess.Popen(cmd, cwd=HERE, env=SCRIPT_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=as_nohup_and_a_background_job)
    log = out / "log.jsonl"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGINT)
    logged_then = len(logged_losses(out))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr
    assert logged_then < STEPS and len(logged_losses(out)) == STEPS


def test_a_reader_that_goes_away_does_not_stop_the_run(train_data, tmp_path, reference_run):
    """`train.py | head`, or `nohup train.py | tee log &` at logout: once the pipe is closed the output goes
    nowhere, and the run trains to its end as if nothing had happened (only signals stop a run)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *EXACT]
    proc = subprocess.Popen(cmd, cwd=HERE, env={**SCRIPT_ENV, **THREADED}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()  # the config line, then the reader is gone
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, stderr
    assert stderr == ""
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == STEPS
    assert logged_losses(out) == reference_run


def readme_torchrun_options():
    """The options before train.py in every torchrun line of the README's bash blocks."""
    text = Path(HERE, "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    lines = [line.split("#")[0] for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    launches = [line.split("torchrun", 1)[1].split("train.py")[0] for line in lines if "torchrun" in line]
    return launches, {token.split("=")[0] for launch in launches for token in launch.split() if token.startswith("--")}


def test_every_torchrun_option_in_the_readme_exists_in_this_torch():
    """torchrun stops with "unrecognized arguments" before train.py runs: every option the README
    gives it must be one this torch's torchrun knows, unless the README says it needs a newer torch."""
    import torch.distributed.run as torchrun
    known = {s for action in torchrun.get_args_parser()._actions for s in action.option_strings}
    launches, options = readme_torchrun_options()
    text = Path(HERE, "README.md").read_text()
    since = dict(re.findall(r"`(--[\w-]+)` exists in torchrun from PyTorch (\d+\.\d+)", text)
                 + re.findall(r"and `(--[\w-]+)` from (\d+\.\d+)", text))
    assert set(since) == {"--shutdown-timeout", "--signals-to-handle"}, since
    this = tuple(int(part) for part in torch.__version__.split(".")[:2])
    needed = {o for o in options if tuple(int(part) for part in since.get(o, "2.4").split(".")) <= this}
    assert len(launches) >= 3 and "--nproc_per_node" in needed
    assert needed <= known, needed - known
