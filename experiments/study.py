"""The CPU-scale study: where does Leviathan win, lose or tie against the tied and untied
baselines once every arm has its own learning rates? Its report, with every run, is
experiments/study.md.

Run from the repository root:

    python prepare_data.py --dataset=demo                                  # data/demo (8,192 ids)
    python prepare_data.py --dataset=demo --vocab_size=32768 --out_dir=data/demo32k
    python -m experiments.study prepare       # data/<name>-tune and data/<name>-final (val cut in two)
    python -m experiments.study sweep tune final vocab32k long edges retuned [--deadline=HH:MM]
    python -m experiments.study sweep width64 width128 width256 tune-long compare-long   # the second part
    python -m experiments.study sweep lev-variants vocab32k-long lev-variants-seed2      # the third part
    python -m experiments.study table         # every run, the seed summary, the frequency buckets
    python -m experiments.study plot          # experiments/figures/*.png (needs `pip install matplotlib`)

The protocol is the PLANS below; study.md says which plans were fixed before any result and which
were added after. Learning rates are chosen on the TUNING half of the validation split; the tables
report the FINAL half, which no choice saw. Plans run in the order given; `final`, `vocab32k` and
`long` use each arm's best `tune` run, so `tune` must be finished first, `retuned` needs `edges` and
`compare-long` needs `tune-long`; the third part states every setting in its plans. `sweep` drives
train.py in a subprocess (runs.py), one run at a time, skips finished runs and resumes interrupted
ones, so it can be stopped and started again at will.
On a machine busy with other jobs, `OMP_NUM_THREADS=1 python -m experiments.study sweep ...` trains
faster: two OpenMP threads on oversubscribed cores spend their time waiting for each other.
`--part=K/N` shares a plan's runs among N sweeps, one per core, for example on two cores:

    for k in 1 2; do OMP_NUM_THREADS=1 python -m experiments.study sweep tune-long --part=$k/2 & done; wait
    for k in 1 2; do OMP_NUM_THREADS=1 python -m experiments.study sweep compare-long --part=$k/2 & done; wait

A plan that needs another's results (compare-long needs tune-long) starts after all its parts end;
`lev-variants-seed2` instead waits, in each part, until the other parts have finished `lev-variants`,
so the third part runs in one go:

    for k in 1 2; do OMP_NUM_THREADS=1 python -m experiments.study sweep lev-variants vocab32k-long lev-variants-seed2 --part=$k/2 & done; wait
"""
import glob
import json
import os
import statistics
import sys
import time
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.study")

import numpy as np

from experiments import lev_variants
from experiments.cli import run_main
from experiments.runs import (check_same_data, finished, last_evaluation, log_records, markdown, read_config,
                              side_by_side, train as train_run)
from prepare_data import UserError, load_meta, read_shard, shard_paths, write_shard
from train import read_options

STUDY_DIR = os.path.join("out", "study")  # relative to the repository root, where the commands run
FIGURES_DIR = os.path.join("experiments", "figures")
TINY = read_options(["--size=tiny"])  # train.py's tiny size
BATCH_TOKENS = TINY.batch_tokens  # 4,096 tokens per step; budgets are given in steps
FULL_STEPS = TINY.total_tokens // BATCH_TOKENS  # 660 steps = 2.7M tokens
ARMS = ("lev", "tied", "untied")
SEEDS = (1337, 1338)
# The first plans (tune to long) computed LEV's step 3b as t = sigmoid(u); leviathan.py's default
# is the paper's t = sigmoid(u / 2), so those plans ask for their own form to repeat their runs.
FIRST_FORM = ["--lev_sigmoid_scale=1"]
LONG_SHAPE = ["--d_model=64", "--n_layer=2", "--n_head=2"]  # regime (a)
WIDTHS = (64, 128, 256)  # the width sweep: the tiny depth (4 layers), heads of 32 dims
# The third part's lev: the long regime's tune-long choice (study.md, "Long comparison: results").
LONG_LEV = dict(arm="lev", lr=3e-3, lr_input=0.1, lr_head=30.0)
# LEV's variants, each one change from leviathan.py's LEV, as the options that make it: train.py's,
# or lev_variants.py's --lev_variant=, with which the sweep runs it (that file says why).
LEV_VARIANTS = {
    "plain-sigmoid": ["--lev_sigmoid_scale=1"],  # 3b: t = sigmoid(u), not sigmoid(u / 2)
    "raw-basis": [lev_variants.OPTION + "raw-basis"],  # 3c: the basis not renormalised
    "knot-scale": [lev_variants.OPTION + "knot-scale"],  # 3c: a learnable scale on the distance to the knots
    "knots32": ["--lev_knots=32"],  # 3c: the paper's v1 knot count
}
# The two-seed spread of the long comparison's lev in final validation loss: 27.30 and 26.05 ppl
# (seeds 1337 and 1338), ln(27.30 / 26.05) = 0.047 nats. A variant that moves lev's final loss by
# more gets a second seed.
LEV_SEED_SPREAD = 0.047


def grid(arm, lrs, scales):
    """Tuning runs of one arm: each backbone lr with each (lr_input, lr_head) pair."""
    return [dict(arm=arm, lr=lr, lr_input=lr_input, lr_head=lr_head) for lr in lrs for lr_input, lr_head in scales]


def multiplier_grid(lr=3e-3):
    """The runs of the width sweep and of the long comparison's tuning: the backbone at lr, and
    one multiplier at a time moved x3 either way from the first study's choice (tied x30; untied
    head x30; LEV x0.3 with its head at x30): the tied table, the untied head, LEV's head, LEV."""
    return (grid("tied", [lr], [(10.0, 1.0), (30.0, 1.0), (100.0, 1.0)])
            + grid("untied", [lr], [(1.0, 10.0), (1.0, 30.0), (1.0, 100.0)])
            + grid("lev", [lr], [(0.3, 10.0), (0.3, 30.0), (0.3, 100.0), (0.1, 30.0), (1.0, 30.0)]))


# Each plan: the data folder, the steps, the seeds, extra train.py options, and its runs. The
# tuning grid is centred on a preliminary sweep made before the study (tied: 3e-3 and 6e-3 within
# 2%; the zero-initialised untied head wants ~10x the backbone's rate; LEV ~1/10 of it with the
# head at x10) and gives every arm the same number of runs (2). All budgets are sized for ~100
# minutes of 2 CPU cores shared with other work (~1-2k tokens/s): tuning at 110 steps (450k
# tokens), the comparison at 220 steps (901k tokens, a third of the tiny preset's 660). Short runs
# favour higher learning rates, a bias every arm shares.
PLANS = {
    "tune": dict(data="data/demo-tune", steps=FULL_STEPS // 6, seeds=SEEDS[:1], options=FIRST_FORM, runs=(
        grid("tied", [3e-3, 6e-3], [(1.0, 1.0)]) + grid("untied", [3e-3], [(1.0, 10.0), (1.0, 30.0)])
        + grid("lev", [3e-3], [(0.1, 10.0), (0.3, 10.0)]))),
    # Added after the results of `tune`, `final`, `vocab32k` and `long` were known (not part of
    # the protocol fixed beforehand): one step past each edge of the grid above, and tied's table
    # at the rates the untied head preferred (x10, then x30 and x100 as each won), to see whether
    # an optimum lies beyond the grid. `final` keeps the settings chosen on `tune`; `retuned`
    # reruns the arms whose choice moved.
    "edges": dict(data="data/demo-tune", steps=FULL_STEPS // 6, seeds=SEEDS[:1], options=FIRST_FORM, runs=(
        grid("tied", [3e-3], [(10.0, 1.0), (30.0, 1.0), (100.0, 1.0)]) + grid("untied", [3e-3], [(1.0, 100.0)])
        + grid("lev", [3e-3], [(1.0, 10.0), (0.3, 30.0)]))),
    # Regime 0 again, for each arm whose best setting moved with `edges`; added with `edges`.
    "retuned": dict(data="data/demo-final", steps=FULL_STEPS // 3, seeds=SEEDS, options=FIRST_FORM, runs="retuned"),
    # Regime 0: the tiny preset's model and 8,192-id vocabulary, two seeds.
    "final": dict(data="data/demo-final", steps=FULL_STEPS // 3, seeds=SEEDS, options=FIRST_FORM, runs="best"),
    # Regime (b): a 32,768-id vocabulary, so that rare targets exist. 31.9 MFLOP per token
    # against 13.0 at 8,192 ids (leviathan.Model.flops_per_token): ~2.5x slower.
    # The second seed was added after lev's first run at 32,768 ids had finished, before tied's
    # or untied's had.
    "vocab32k": dict(data="data/demo32k-final", steps=FULL_STEPS // 3, seeds=SEEDS, options=FIRST_FORM, runs="best"),
    # Regime (a): toward the paper's ~20 tokens per parameter with a smaller model (tied 0.66M
    # parameters, lev 1.0M, untied 1.18M) on 12.3M tokens (19 / 12 / 10 tokens per parameter),
    # ~3.5 passes over the demo corpus.
    "long": dict(data="data/demo-final", steps=3000, seeds=SEEDS[:1], options=FIRST_FORM + LONG_SHAPE, runs="best"),
    # The plans below compute step 3b as the paper does (leviathan.py's default) and were fixed
    # before any of their runs. The width sweep: how each arm's best multipliers move with D, at
    # the tuning budget of `tune`; the rule for the paper sizes' defaults is fitted to it.
    **{f"width{d}": dict(data="data/demo-tune", steps=FULL_STEPS // 6, seeds=SEEDS[:1],
                         options=[f"--d_model={d}", f"--n_head={d // 32}"], runs=multiplier_grid()) for d in WIDTHS},
    # The long comparison: regime (a), each arm tuned at a quarter of the final length, then
    # compared at 3,000 steps with two seeds and an evaluation every 250 steps.
    "tune-long": dict(data="data/demo-tune", steps=750, seeds=SEEDS[:1], options=LONG_SHAPE, runs=multiplier_grid()),
    "compare-long": dict(data="data/demo-final", steps=3000, seeds=SEEDS, options=LONG_SHAPE, runs="best",
                         tuned_on="tune-long", evaluations=12),
    # The third part, fixed before any of its runs; every setting is written out here, none taken
    # from earlier run folders. All in the long comparison's regime (LONG_SHAPE, 3,000 steps, the
    # final half, an evaluation every 250 steps, the paper's step 3b).
    # Is the gap to tied the reconstruction's? Lev at its tune-long rates, and each of
    # LEV_VARIANTS, one change from it at those rates (not retuned), seed 1337. Lev itself reruns
    # compare-long's seed-1337 run, so that every variant is compared with a run of the same code
    # on the same machine.
    "lev-variants": dict(data="data/demo-final", steps=3000, seeds=SEEDS[:1], options=LONG_SHAPE, evaluations=12,
                         runs=[LONG_LEV] + [dict(LONG_LEV, variant=name) for name in LEV_VARIANTS]),
    # Seed 1338 for every variant whose seed-1337 final loss differs from lev's by more than
    # LEV_SEED_SPREAD, and for lev itself if any does (second_seed_runs): decided by this rule
    # from lev-variants' results, not by hand. A sweep in parts waits here for the other parts'
    # lev-variants runs.
    "lev-variants-seed2": dict(data="data/demo-final", steps=3000, seeds=SEEDS[1:], options=LONG_SHAPE,
                               evaluations=12, runs="second-seed", derived_from="lev-variants"),
    # Does the vocabulary matter? The same regime at 32,768 ids, one seed, each arm at the rates it
    # preferred at 8,192 ids in tune-long (tied: table x10; untied: head x30; lev: LEV x0.1, head
    # x30), carried over, not retuned at 32,768 ids.
    "vocab32k-long": dict(data="data/demo32k-final", steps=3000, seeds=SEEDS[:1], options=LONG_SHAPE, evaluations=12,
                          runs=[LONG_LEV, dict(arm="tied", lr=3e-3, lr_input=10.0, lr_head=1.0),
                                dict(arm="untied", lr=3e-3, lr_input=1.0, lr_head=30.0)]),
}
VARIANT_PLANS = ("lev-variants", "lev-variants-seed2")  # lev against its variants: no tied or untied arm
FIRST_TUNING = ("tune", "edges")
# scored on the tuning half: only their last step, no buckets or plots
TUNING_PLANS = FIRST_TUNING + tuple(f"width{d}" for d in WIDTHS) + ("tune-long",)


# ---------------------------------------------------------------------------- prepare

def split_val(val, eot_id):
    """Cut the validation tokens in two at the end-of-text nearest the middle, so that no
    document is in both halves: (tuning half, final half)."""
    ends = np.flatnonzero(val == eot_id) + 1  # a document ends just after its end-of-text
    if len(ends) == 0:
        raise UserError("the validation split has no end-of-text token to cut at")
    cut = int(ends[np.argmin(np.abs(ends - len(val) / 2))])
    return val[:cut], val[cut:]


def prepare_one(source):
    """data/<name>-tune and data/<name>-final: links to the source's training shards, counts.npy and
    token_bytes.npy, and one half of its validation split each."""
    meta = load_meta(source)
    val = np.concatenate([read_shard(p)[:] for p in shard_paths(source, "val")])
    for half, tokens in zip(("tune", "final"), split_val(val, meta["eot_id"])):
        target = f"{source}-{half}"
        os.makedirs(target, exist_ok=True)
        sidecars = [os.path.join(source, name) for name in ("counts.npy", "token_bytes.npy")]
        for path in shard_paths(source, "train") + sidecars:
            link = os.path.join(target, os.path.basename(path))
            if not os.path.lexists(link):
                os.symlink(os.path.relpath(path, target), link)
        write_shard(os.path.join(target, "val_000000.bin"), tokens, meta["vocab_size"])
        half_meta = dict(meta, command=f"python -m experiments.study prepare  "
                                       f"(the {half} half of {source}'s val split)")
        half_meta["splits"] = dict(meta["splits"], val=dict(tokens=len(tokens), shards=1))
        with open(os.path.join(target, "meta.json"), "w") as f:  # last: its presence means "complete"
            json.dump(half_meta, f, indent=2)
        print(f"{target}: {len(tokens):,} validation tokens")


def prepare(sources=("data/demo", "data/demo32k")):
    for source in sources:
        if not os.path.isfile(os.path.join(source, "meta.json")):
            name = os.path.basename(source)
            raise UserError(f"{source} is missing: run `python prepare_data.py --dataset=demo"
                            + ("" if name == "demo" else f" --vocab_size=32768 --out_dir={source}") + "` first")
        prepare_one(source)


# ---------------------------------------------------------------------------- runs

def run_name(run, seed):
    head = "" if run["arm"] == "tied" else f"-head{run['lr_head']:g}"
    return f"{arm_label(run['arm'], run.get('variant'))}-lr{run['lr']:g}-in{run['lr_input']:g}{head}-seed{seed}"


def arm_label(arm, variant=None):
    """How the tables name an arm: lev's variants as lev-<variant> (the start of their run folders' names)."""
    return f"{arm}-{variant}" if variant else arm


def run_label(config):
    """arm_label of a run from its config.json: the variant is in its folder's name only (run_name)."""
    arm, name = config["train"]["embedding"], os.path.basename(config["train"]["out_dir"])
    variant = next((v for v in LEV_VARIANTS if name.startswith(arm_label(arm, v) + "-lr")), None)
    return arm_label(arm, variant)


def best_settings(arm, plan_names=("tune",)):
    """The tuning run of `arm` with the lowest validation loss over the given tuning plans (the
    protocol's only choice)."""
    done = []
    for plan_name in plan_names:
        plan = PLANS[plan_name]
        runs = [r for r in plan["runs"] if r["arm"] == arm]
        evals = [last_evaluation(os.path.join(STUDY_DIR, plan_name, run_name(r, plan["seeds"][0]))) for r in runs]
        if not all(e and e["step"] == plan["steps"] for e in evals):
            raise UserError(f"the {plan_name} runs of {arm} are not all finished: "
                            f"run `python -m experiments.study sweep {plan_name}` first")
        done += [(e["val_loss"], r) for e, r in zip(evals, runs)]
    return min(done, key=lambda pair: pair[0])[1]


def retuned_runs():
    """The arms whose best setting moved once the `edges` runs joined the choice."""
    choices = [(best_settings(arm, FIRST_TUNING), best_settings(arm)) for arm in ARMS]
    return [with_edges for with_edges, tune_only in choices if with_edges != tune_only]


def second_seed_runs(plan_name):
    """The runs of the plan that get a second seed: every variant whose final validation loss at
    the first seed differs from lev's by more than LEV_SEED_SPREAD, and lev itself if any does."""
    plan = PLANS[plan_name]
    losses = []
    for run in plan["runs"]:
        ev = last_evaluation(os.path.join(STUDY_DIR, plan_name, run_name(run, plan["seeds"][0])))
        if not (ev and ev["step"] == plan["steps"]):
            raise UserError(f"the {plan_name} runs are not all finished: run `python -m experiments.study sweep "
                            f"{plan_name}` first")
        losses.append(ev["val_loss"])
    lev_loss = losses[plan["runs"].index(LONG_LEV)]
    moved = [run for run, loss in zip(plan["runs"], losses) if abs(loss - lev_loss) > LEV_SEED_SPREAD]
    return [LONG_LEV] + moved if moved else []


def planned_runs(plan_name):
    """(out_dir, train.py arguments but --out_dir) of every run of the plan, in order; a variant's
    arguments include --lev_variant= where lev_variants.py must run it."""
    plan = PLANS[plan_name]
    runs = ([best_settings(arm, (plan.get("tuned_on", "tune"),)) for arm in ARMS] if plan["runs"] == "best"
            else retuned_runs() if plan["runs"] == "retuned"
            else second_seed_runs(plan["derived_from"]) if plan["runs"] == "second-seed" else plan["runs"])
    out = []
    for seed in plan["seeds"]:  # all arms at one seed before the next: a cut-short sweep stays comparable
        for run in runs:
            out_dir = os.path.join(STUDY_DIR, plan_name, run_name(run, seed))
            evaluations = plan.get("evaluations", 1 if plan_name in TUNING_PLANS else 4)  # curves need points; tuning the end
            args = [f"--embedding={run['arm']}", f"--data_dir={plan['data']}",
                    f"--lr={run['lr']}", f"--lr_input={run['lr_input']}", f"--seed={seed}",
                    f"--total_tokens={plan['steps'] * BATCH_TOKENS}", f"--eval_interval={plan['steps'] // evaluations}",
                    "--eval_tokens=1000000000"]  # the whole validation half
            args += [] if run["arm"] == "tied" else [f"--lr_head={run['lr_head']}"]
            out.append((out_dir, args + plan["options"] + LEV_VARIANTS.get(run.get("variant"), [])))
    return out


def measured_speed(plan):
    """Median training tokens/s of the runs so far (finished or not) with this plan's vocabulary
    and model options, which fix the speed; None before the first."""
    vocab = load_meta(plan["data"])["vocab_size"]
    speeds = [speed for plan_name, _, config, _, speed in load_runs() if speed and plan_name in PLANS
              and config["model"]["vocab_size"] == vocab and PLANS[plan_name]["options"] == plan["options"]]
    return statistics.median(speeds) if speeds else None


def sweep(plan_names, deadline=None, part=(1, 1)):
    """Run the plans' runs one at a time. With a deadline: skip a run whose estimated time (from
    the speed measured on its shape) ends after it, and stop the one in progress when it comes.
    part=(k, n) takes every n-th run from the k-th, so n sweeps on n cores never share a run folder."""
    k, n = part
    for plan_name in plan_names:
        plan = PLANS[plan_name]
        if not os.path.isfile(os.path.join(plan["data"], "meta.json")):  # train.py would name prepare_data.py
            raise UserError(f"{plan['data']} is missing: run `python -m experiments.study prepare` first")
        if "derived_from" in plan and not wait_for_other_parts(plan["derived_from"], part, deadline):
            print(f"not run: {plan_name} (the {plan['derived_from']} runs it needs were not finished by the deadline)",
                  flush=True)
            continue
        for out_dir, args in planned_runs(plan_name)[k - 1::n]:
            variant = [a for a in args if a.startswith(lev_variants.OPTION)]  # lev_variants' own
            if finished(out_dir, [a for a in args if a not in variant]):
                continue
            speed = measured_speed(plan)
            estimate = plan["steps"] * BATCH_TOKENS / speed * 1.1 if speed else None  # +10% for evaluations
            if deadline and time.time() + (estimate or 0) > deadline:  # a shape not yet measured: try it
                print(f"not run: {out_dir} (estimated {(estimate or 0) / 60:.0f} min, past the deadline)", flush=True)
                continue
            code, stopped = train_run(out_dir, args, output=os.path.join(out_dir, "train.out"), deadline=deadline,
                                      note=f" (estimated {estimate / 60:.0f} min)" if estimate else "",
                                      module=lev_variants.__name__ if variant else None)
            if stopped:  # train.py saved a checkpoint and exited: rerun to resume
                print(f"  stopped at the deadline; `python -m experiments.study sweep {plan_name}` resumes it",
                      flush=True)
            elif code:
                print(f"  train.py exited with {code}; see {out_dir}/train.out", flush=True)


def wait_for_other_parts(plan_name, part, deadline=None, poll_s=60):
    """Wait until the runs of the plan that the other parts of a --part sweep train have finished:
    a plan derived from its results needs all of them. This part's own runs are already behind it.
    False if the deadline came first; without one, it waits as long as the other parts take (so
    start them all)."""
    k, n = part
    others = [out_dir for i, (out_dir, _) in enumerate(planned_runs(plan_name)) if i % n != k - 1]
    if not all(finished(out_dir) for out_dir in others):
        print(f"{time.strftime('%H:%M')} waiting for the other parts to finish {plan_name}", flush=True)
    while not all(finished(out_dir) for out_dir in others):
        if deadline and time.time() > deadline:
            return False
        time.sleep(poll_s)
    return True


# ---------------------------------------------------------------------------- results

def load_runs(root=STUDY_DIR):
    """(plan, run folder, config, last evaluation, median tokens/s) of every run folder under root/<plan>/:
    the folder where it is, which a copied or moved run's config.json (its out_dir) does not give."""
    runs = []
    for config_path in sorted(glob.glob(os.path.join(root, "*", "*", "config.json"))):
        out_dir = os.path.dirname(config_path)
        config = read_config(out_dir)
        if not (isinstance(config, dict) and isinstance(config.get("train"), dict)):
            continue  # not a train.py run: an export's config.json, say
        speeds = [r["tokens_per_s"] for r in log_records(out_dir, "train")]
        runs.append((os.path.basename(os.path.dirname(out_dir)), out_dir, config, last_evaluation(out_dir),
                     statistics.median(speeds) if speeds else None))
    return runs


def settings(config):
    t = config["train"]
    head = "-" if t["embedding"] == "tied" else f"x{t['lr_head']:g}"
    return f"{t['lr']:g}", f"x{t['lr_input']:g}", head


def table(root=STUDY_DIR):
    """Markdown: every run (finished or not), the mean and spread over seeds of the finished
    ones, and for every plan but tuning the gap along training and the frequency buckets."""
    runs = load_runs(root)
    rows = []
    for plan, _, config, ev, speed in runs:
        result = ([ev["step"], f"{ev['tokens_seen']:,}", f"{ev['val_loss']:.4f}", f"{ev['val_ppl']:.2f}"] if ev
                  else ["-"] * 4)
        rows.append([plan, run_label(config), *settings(config), config["train"]["seed"], *result,
                     f"{speed:,.0f}" if speed else "-"])
    header = ["plan", "arm", "lr", "input lr", "head lr", "seed", "steps", "tokens", "val loss", "val ppl", "tokens/s"]
    print("\n".join(markdown(header, rows, labels=5)))
    groups = {}  # (plan, arm, settings) -> the finished runs' last evaluations, one per seed
    group_dirs = {}  # the same key -> those runs' folders
    curves = {}  # (plan, arm) -> {step: (tokens, val loss)} of each finished run
    for plan, run_dir, config, ev, _ in runs:
        if ev and ev["tokens_seen"] == config["train"]["total_tokens"]:
            key = (plan, run_label(config), settings(config))
            groups.setdefault(key, []).append(ev)
            group_dirs.setdefault(key, []).append(run_dir)
            curve = {r["step"]: (r["tokens_seen"], r["val_loss"]) for r in log_records(run_dir, "eval")}
            curves.setdefault((plan, run_label(config)), []).append(curve)
    for run_dirs in group_dirs.values():  # seeds averaged must differ in their seed alone
        check_same_data(run_dirs)
    print("\nMean over seeds (spread: max - min); finished runs only:\n")
    rows = []
    for (plan, arm, lrs), evs in groups.items():
        ppls = [e["val_ppl"] for e in evs]
        rows.append([plan, arm, ", ".join(lrs), len(evs), f"{statistics.mean(e['val_loss'] for e in evs):.4f}",
                     f"{statistics.mean(ppls):.2f} ({' / '.join(f'{p:.2f}' for p in ppls)})",
                     f"{max(ppls) - min(ppls):.2f}" if len(ppls) > 1 else "-"])
    header = ["plan", "arm", "lr, input, head", "seeds", "val loss", "val ppl (each seed)", "ppl spread"]
    print("\n".join(markdown(header, rows, labels=3)))
    for plan in sorted({key[0] for key in groups} - set(TUNING_PLANS)):
        plan_curves = {arm: c for (p, arm), c in curves.items() if p == plan}
        if plan in VARIANT_PLANS:
            variant_table(plan, plan_curves)
            continue
        gap_table(plan, plan_curves)
        bucket_table(plan, {key[1]: evs for key, evs in groups.items() if key[0] == plan})
    width_rule(root)


# The width sweep's four lines: (arm, the multiplier moved, the one held, its value).
WIDTH_LINES = (("tied", "lr_input", "lr_head", 1.0), ("untied", "lr_head", "lr_input", 1.0),
               ("lev", "lr_head", "lr_input", 0.3), ("lev", "lr_input", "lr_head", 30.0))
PAPER_WIDTHS = {"200m": 768, "400m": 1024, "1.2b": 2048}


def best_multiplier(values, losses):
    """The multiplier at the vertex of the parabola through the three (log x, loss) points, kept
    within the grid (the grid says nothing beyond it); the best grid point if the parabola has
    no minimum."""
    a, b, _ = np.polyfit(np.log(values), losses, 2)
    if a <= 0:
        return values[int(np.argmin(losses))]
    return float(np.clip(np.exp(-b / (2 * a)), min(values), max(values)))


def width_rule(root=STUDY_DIR):
    """Markdown: each line's validation loss per multiplier and width, the best multiplier per
    width, and the power law in D fitted to them (least squares of log best on log D) carried to
    the paper's widths. Only a count while some width runs are missing."""
    losses = {}
    for width in WIDTHS:
        for run in multiplier_grid():
            ev = last_evaluation(os.path.join(root, f"width{width}", run_name(run, SEEDS[0])))
            if ev and ev["step"] == PLANS[f"width{width}"]["steps"]:
                losses[width, tuple(sorted(run.items()))] = ev["val_loss"]
    if len(losses) < len(WIDTHS) * len(multiplier_grid()):
        print(f"\nwidth sweep: {len(losses)} of {len(WIDTHS) * len(multiplier_grid())} runs finished")
        return
    print("\nWidth sweep (tuning half, 110 steps): validation loss; best: the fitted optimum\n")
    rows = []
    for arm, moved, held, held_value in WIDTH_LINES:
        runs = sorted((r for r in multiplier_grid() if r["arm"] == arm and r[held] == held_value), key=lambda r: r[moved])
        values = [r[moved] for r in runs]
        cells, best = [], []
        for width in WIDTHS:
            line = [losses[width, tuple(sorted(r.items()))] for r in runs]
            best.append(best_multiplier(values, line))
            cells.append(" / ".join(f"{loss:.4f}" for loss in line) + f"; best x{best[-1]:.3g}")
        exponent, log_scale = np.polyfit(np.log(np.array(WIDTHS) / 128), np.log(best), 1)
        law = f"x{np.exp(log_scale):.3g} (D / 128)^{exponent:+.2f}"
        carried = [f"x{np.exp(log_scale) * (d / 128) ** exponent:.3g}" for d in PAPER_WIDTHS.values()]
        label = f"{moved} (x{' / x'.join(f'{v:g}' for v in values)}; {held} x{held_value:g})"
        rows.append([arm, label, *cells, law, *carried])
    header = ["arm", "multiplier", *(f"D = {w}" for w in WIDTHS), "fitted law",
              *(f"D = {d}" for d in PAPER_WIDTHS.values())]
    print("\n".join(markdown(header, rows, labels=2)))


def gap_table(plan, curves_by_arm):
    """Validation loss at each evaluation every run of the plan made, mean over seeds, and lev's
    difference to each baseline in nats (and in perplexity): the gap along training."""
    arms = [arm for arm in ARMS if arm in curves_by_arm]
    baselines = [arm for arm in ("tied", "untied") if "lev" in arms and arm in arms]
    difference_table(plan, curves_by_arm, arms, [("lev", b) for b in baselines])


def variant_table(plan, curves_by_arm):
    """gap_table for lev's variants: each variant's loss along training, and its difference to lev's."""
    variants = [arm_label("lev", v) for v in LEV_VARIANTS if arm_label("lev", v) in curves_by_arm]
    arms = (["lev"] if "lev" in curves_by_arm else []) + variants
    difference_table(plan, curves_by_arm, arms, [(v, "lev") for v in variants if "lev" in arms])


def difference_table(plan, curves_by_arm, arms, pairs):
    """Markdown: the arms' validation loss at each evaluation all their runs made (mean over
    seeds), then each pair's difference a - b in nats (and in perplexity)."""
    steps = sorted(set.intersection(*(set(c) for arm in arms for c in curves_by_arm[arm])))
    print(f"\n{plan}: validation loss along training (mean over seeds, nats)\n")
    rows = []
    for step in steps:
        loss = {arm: statistics.mean(c[step][1] for c in curves_by_arm[arm]) for arm in arms}
        gaps = [loss[a] - loss[b] for a, b in pairs]
        cells = [f"{loss[a]:.4f}" for a in arms] + [f"{g:+.4f} ({100 * np.expm1(g):+.1f}%)" for g in gaps]
        rows.append([step, f"{curves_by_arm[arms[0]][0][step][0]:,}", *cells])
    print("\n".join(markdown(["step", "tokens", *arms, *(f"{a} - {b}" for a, b in pairs)], rows, labels=0)))


def bucket_table(plan, evals_by_arm):
    """Perplexity by the target's training count, mean over seeds of each bucket's loss, and
    lev's perplexity relative to each baseline."""
    arms = [arm for arm in ARMS if arm in evals_by_arm]
    print(f"\n{plan}: validation perplexity by the target's training count (mean loss over seeds)\n")
    rows = []
    for j, row in enumerate(evals_by_arm[arms[0]][0]["buckets"]):
        if row["tokens"]:
            ppl = {arm: float(np.exp(np.mean([e["buckets"][j]["loss"] for e in evals_by_arm[arm]]))) for arm in arms}
            rows.append(([row["counts"], f"{row['tokens']:,}"], {a: (p, f"{p:,.1f}") for a, p in ppl.items()}, []))
    print("\n".join(side_by_side(["training count", "val tokens"], arms, "lev", rows)))


COLOURS = dict(lev="tab:red", tied="tab:blue", untied="tab:green")


def plot_losses(plt, plan, runs):
    """Validation loss (the evaluations) and training loss (every 10th step) against tokens."""
    fig, (val_ax, train_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for _, run_dir, config, _, _ in runs:
        t = config["train"]
        style = dict(color=COLOURS[t["embedding"]], linestyle="-" if t["seed"] == SEEDS[0] else "--",
                     label=f"{t['embedding']} (seed {t['seed']})")
        for ax, kind, key in ((val_ax, "eval", "val_loss"), (train_ax, "train", "loss")):
            points = [(r["tokens_seen"] / 1e6, r[key]) for r in log_records(run_dir, kind)]
            ax.plot(*zip(*points), marker="o" if kind == "eval" else None, **style)
    val_ax.set(xlabel="training tokens (millions)", ylabel="loss (nats)", title=f"{plan}: validation loss")
    train_ax.set(xlabel="training tokens (millions)", title=f"{plan}: training loss (one batch)", ylim=(None, 7))
    val_ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES_DIR, f"loss_{plan}.png"), dpi=110)
    plt.close(fig)


def plot_buckets(plt, plan, runs):
    """Perplexity per frequency bucket: a group of bars per bucket, the mean loss over seeds."""
    by_arm = {}
    for _, _, config, ev, _ in runs:
        by_arm.setdefault(config["train"]["embedding"], []).append(ev)
    arms = [arm for arm in ARMS if arm in by_arm]
    buckets = by_arm[arms[0]][0]["buckets"]
    rows = [j for j, row in enumerate(buckets) if row["tokens"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        ppl = [np.exp(np.mean([e["buckets"][j]["loss"] for e in by_arm[arm]])) for j in rows]
        offset = (k - (len(arms) - 1) / 2) * width  # the arms side by side around each bucket
        ax.bar(np.arange(len(rows)) + offset, ppl, width=width, color=COLOURS[arm], label=arm)
    ax.set_xticks(np.arange(len(rows)), [f"{buckets[j]['counts']}\n({buckets[j]['tokens']:,})" for j in rows])
    ax.set(yscale="log", xlabel="target's count in the training split (validation tokens)",
           ylabel="validation perplexity", title=f"{plan}: perplexity by frequency bucket")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(FIGURES_DIR, f"buckets_{plan}.png"), dpi=110)
    plt.close(fig)


def plot(root=STUDY_DIR):
    """experiments/figures/loss_<plan>.png and experiments/figures/buckets_<plan>.png for every plan but
    tuning and lev's variants (one colour per arm), from its finished runs."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plot needs matplotlib: pip install matplotlib") from None
    os.makedirs(FIGURES_DIR, exist_ok=True)
    finished = [(plan, run_dir, config, ev, speed) for plan, run_dir, config, ev, speed in load_runs(root)
                if plan not in TUNING_PLANS + VARIANT_PLANS and ev and ev["tokens_seen"] == config["train"]["total_tokens"]]
    for plan in sorted({r[0] for r in finished}):
        runs = [r for r in finished if r[0] == plan]
        plot_losses(plt, plan, runs)
        plot_buckets(plt, plan, runs)
        print(f"wrote {FIGURES_DIR}/loss_{plan}.png and {FIGURES_DIR}/buckets_{plan}.png")


# ---------------------------------------------------------------------------- command line

def parse_deadline(text):
    """HH:MM on the current day (local time) -> seconds since the epoch."""
    try:
        hours, minutes = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--deadline={text}: expected HH:MM") from None
    if not (0 <= hours <= 23 and 0 <= minutes <= 59):
        raise UserError(f"--deadline={text}: expected HH:MM with hours 0-23 and minutes 0-59")
    deadline = time.mktime(time.localtime()[:3] + (hours, minutes, 0, 0, 0, -1))
    if deadline <= time.time():  # else every run would be skipped, and the sweep end at once
        raise UserError(f"--deadline={text} is already past (it is {time.strftime('%H:%M')}): give a later time today")
    return deadline


def parse_part(text):
    """K/N -> (k, n): the k-th of n sweeps that share the plans' runs."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--part={text}: expected K/N, for example 1/2") from None
    if not 1 <= k <= n:
        raise UserError(f"--part={text}: expected 1 <= K <= N")
    return k, n


def main(argv):
    commands = ("prepare", "sweep", "table", "plot")
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if not argv or argv[0] not in commands:
        raise UserError(f"expected one of {', '.join(commands)} (see the top of experiments/study.py)")
    command, rest = argv[0], argv[1:]
    options = {"--deadline": parse_deadline, "--part": parse_part}
    given = {name: parse(a.removeprefix(name + "=")) for a in rest for name, parse in options.items()
             if a.startswith(name + "=")}
    names = [a for a in rest if not a.startswith(tuple(name + "=" for name in options))]
    if command == "sweep":
        unknown = [n for n in names if n not in PLANS]
        if unknown or not names:
            raise UserError(f"sweep needs plans among {', '.join(PLANS)}; got {' '.join(unknown) or 'none'}")
        return sweep(names, given.get("--deadline"), given.get("--part", (1, 1)))
    if rest:
        raise UserError(f"{command} takes no options; got {' '.join(rest)}")
    {"prepare": prepare, "table": table, "plot": plot}[command]()


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
