"""The paper's comparison at one size, in one command: train the three arms, evaluate them and
write the paper's table beside the figures the paper reports.

    python -m experiments.compare --size=1.2b           # every visible GPU (torchrun); run again to resume
    python -m experiments.compare --size=200m --tasks=  # validation and buckets only (no lm-eval)
    python -m experiments.compare --size=tiny --tasks=my_task --include_path=my_tasks/ -- --total_tokens=409600

Each arm trains with train.py's preset for the size into <out_dir>/<arm> (options after `--` go to
every train.py run), then is evaluated by evaluate.py on --tasks. An arm already trained to the end
is not trained again, one stopped is resumed (runs.py), and a task already evaluated is not
evaluated again, so the command can be repeated until the table is complete. The table goes to
<out_dir>/table.md.
"""
import argparse, json, os, shlex, sys
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.compare")

import numpy as np
import torch

from experiments import evaluate, runs  # evaluate's lm-eval import is optional: only the downstream step needs it
from experiments.cli import read_json, run_main
from prepare_data import UserError, hold_folder, write_json
from train import SIZES, read_options

ARMS = ("tied", "untied", "lev")  # the baselines first: lev's figures are read against tied's
# What the paper reports for lev against tied (arXiv 2601.22040): validation perplexity per size,
# the tokens lev needs to reach tied's final loss at 1.2B, and three figures quoted here without
# their model size: LAMBADA perplexity, the rarest and the most frequent frequency bucket.
PAPER_PPL = {"200m": "-2.1%", "400m": "-5.6%", "1.2b": "-9.2%"}
PAPER_TOKENS = {"1.2b": "2.1x fewer"}
PAPER_OTHER = "LAMBADA perplexity -30%; rarest bucket -81%; most frequent bucket near 0"


def parse_args(argv):
    own, train_options = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m experiments.compare", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --size=SIZE [--name=value] [-- train.py's options]", allow_abbrev=False)
    parser.add_argument("--size", required=True, help=" | ".join(SIZES))
    parser.add_argument("--out_dir", help="default out/compare-<size>; the arms train in its subfolders")
    parser.add_argument("--tasks", default=None, help="comma-separated lm-eval tasks (default: evaluate.py's "
                        "six); empty: none")
    parser.add_argument("--include_path", help="a folder of your own lm-eval YAML tasks")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count(),
                        help="GPUs per arm (default: all visible); more than one trains under torchrun")
    args = parser.parse_args(own)
    if args.size not in SIZES:
        raise UserError(f"--size={args.size}: choose one of {', '.join(SIZES)}")
    if not 0 <= args.gpus <= torch.cuda.device_count():
        raise UserError(f"--gpus={args.gpus}: this machine has {torch.cuda.device_count()} GPU(s) "
                        "(0: train on the CPU)")
    if any(o.split("=")[0] in ("--size", "--embedding", "--out_dir", "--resume") for o in train_options):
        raise UserError("experiments.compare sets --size, --embedding, --out_dir and --resume of its train.py runs "
                        "itself")
    if any(o.split("=")[0] in ("--stop_step", "--eval_only") for o in train_options):
        raise UserError("experiments.compare trains every arm to its end and tables its final evaluation: "
                        "leave out --stop_step and --eval_only")
    args.out_dir = args.out_dir or os.path.join("out", f"compare-{args.size}")
    args.train_options = train_options
    return args


# ---------------------------------------------------------------------------- training


def arm_options(args, arm):
    return [f"--size={args.size}", f"--embedding={arm}", *args.train_options]


def train(args, arm):
    run_dir, options = os.path.join(args.out_dir, arm), arm_options(args, arm)
    if runs.finished(run_dir, options):
        print(f"{arm}: trained ({run_dir})", flush=True)
        return
    code, _ = runs.train(run_dir, options, processes=max(args.gpus, 1))  # its output goes to the terminal
    if code:
        raise UserError(f"train.py stopped (exit status {code}) while training {arm}; its output is above. "
                        "Run the same experiments.compare command again to resume")


def evaluate_downstream(args, arm, tasks):
    """evaluate.py, in this process, on the tasks this arm has no result for yet."""
    run_dir = os.path.join(args.out_dir, arm)
    done = os.path.join(run_dir, evaluate.RESULTS_FILE)
    saved = evaluate.read_results(run_dir) if os.path.exists(done) else {}
    # a task looked at with --limit is no full result (evaluate.py says so rather than mixing the two), nor is
    # one of an earlier checkpoint than the arm's last
    final_step = runs.log_records(run_dir, "eval")[-1]["step"]
    missing = [t for t in tasks if t not in saved or saved[t].get("limit") is not None
               or saved[t].get("step") != final_step]
    if missing:
        options = [f"--out_dir={run_dir}", f"--tasks={','.join(missing)}", f"--device={'cuda' if args.gpus else 'cpu'}"]
        options += [f"--include_path={args.include_path}"] if args.include_path else []
        evaluate.evaluate(evaluate.parse_args(options))


# ---------------------------------------------------------------------------- the table


def tokens_to_reach(records, target):
    """Training tokens at which the validation loss first reaches `target`, linear between
    evaluations; None if it never does."""
    previous = None
    for r in records:
        if r["val_loss"] <= target:
            if previous is None:
                return r["tokens_seen"]
            (t0, l0), (t1, l1) = previous, (r["tokens_seen"], r["val_loss"])
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
        previous = (r["tokens_seen"], r["val_loss"])
    return None


def bucket_rows(last_evals):
    """The rarest and the most frequent non-empty bucket of the final evaluations: (label, ppl per arm)."""
    rows = [j for j, row in enumerate(last_evals["tied"]["buckets"]) if row["tokens"]]
    out = []
    for name, j in (("rarest", rows[0]), ("most frequent", rows[-1])):
        row = last_evals["tied"]["buckets"][j]
        label = f"ppl, {name} bucket (training count {row['counts']}, {row['tokens']:,} val tokens)"
        out.append((label, {arm: float(np.exp(e["buckets"][j]["loss"])) for arm, e in last_evals.items()}))
    return out


def downstream_rows(args, tasks):
    """(label, {arm: value}) per task metric present for every arm."""
    if not tasks:
        return []
    results = {arm: evaluate.read_results(os.path.join(args.out_dir, arm)) for arm in ARMS}
    rows = []
    for task in tasks:
        for metric in results["tied"].get(task, {}).get("metrics", {}):
            if "stderr" in metric or not all(metric in results[a].get(task, {}).get("metrics", {}) for a in ARMS):
                continue
            values = {a: results[a][task]["metrics"][metric][0] for a in ARMS}
            rows.append((f"{task} {metric}", values))
    return rows


def table(args, tasks):
    """The paper's table as markdown: each arm's figure, lev against tied and untied, the paper's."""
    runs.check_same_data([os.path.join(args.out_dir, arm) for arm in ARMS])
    records = {arm: runs.log_records(os.path.join(args.out_dir, arm), "eval") for arm in ARMS}
    last = {arm: runs.last_evaluation(os.path.join(args.out_dir, arm)) for arm in ARMS}
    rows = []

    def row(label, values, paper="", fmt="{:.4f}"):
        rows.append(([label], {a: (v, fmt.format(v)) for a, v in values.items()}, [paper]))

    row("validation loss (nats)", {a: last[a]["val_loss"] for a in ARMS})
    row("validation perplexity", {a: last[a]["val_ppl"] for a in ARMS}, PAPER_PPL.get(args.size, ""), "{:.2f}")
    tied_tokens = records["tied"][-1]["tokens_seen"]
    reached = tokens_to_reach(records["lev"], last["tied"]["val_loss"])
    lev_cell = f"{reached:,.0f} ({tied_tokens / reached:.2f}x fewer)" if reached else "not reached"
    rows.append((["training tokens to reach tied's final loss"],  # untied has no figure here
                 {"tied": (tied_tokens, f"{tied_tokens:,}"), "untied": (None, ""), "lev": (reached, lev_cell)},
                 [PAPER_TOKENS.get(args.size, "")]))
    for label, values in bucket_rows(last):
        row(label, values, fmt="{:,.1f}")
    for label, values in downstream_rows(args, tasks):
        row(label, values)
    lines = [f"# Leviathan against its baselines, {args.size}", "",
             *runs.side_by_side([""], ARMS, "lev", rows, ["paper, lev vs tied"]), "",
             f"The paper also reports (model size not given here): {PAPER_OTHER}. Evaluated tokens: "
             f"{last['tied']['eval_tokens']:,}; lower is better for loss and perplexity, higher for accuracy."]
    return "\n".join(lines) + "\n"


def check_same_comparison(args):
    """One comparison per folder: the first command's size and train.py options are kept in
    compare.json, and a later command with others is refused rather than training its arms on, or
    tabling them, as if they were one comparison."""
    path = os.path.join(args.out_dir, "compare.json")
    here = {"size": args.size, "train_options": args.train_options}
    if not os.path.exists(path):
        os.makedirs(args.out_dir, exist_ok=True)
        write_json(path, here)
        return
    there = read_json(path, f"move it aside, or choose another --out_dir than {args.out_dir}")
    if there != here:
        def said(c):  # as the user typed it (an edited file: whatever it holds)
            if not (isinstance(c, dict) and isinstance(c.get("train_options"), list)):
                return json.dumps(c)
            return shlex.join([f"--size={c.get('size')}", *(["--", *c["train_options"]] if c["train_options"] else [])])
        raise UserError(f"{args.out_dir} holds the comparison of `{said(there)}`, not `{said(here)}`: repeat that "
                        "command to complete it, or choose another --out_dir")


def compare(argv):
    args = parse_args(argv)
    tasks = [t for t in (args.tasks if args.tasks is not None else ",".join(evaluate.DEFAULT_TASKS)).split(",") if t]
    if tasks and evaluate.lm_eval is None:  # said before hours of training, not after
        raise UserError(f"downstream tasks need EleutherAI's lm-evaluation-harness: {evaluate.INSTALL} "
                        "(or pass --tasks= to skip them)")
    if tasks:  # every task known, and --include_path's YAML parsing, before training too
        evaluate.task_manager(tasks, args.include_path)
    for arm in ARMS:  # each arm's train.py options read too: a refused command writes nothing
        read_options(arm_options(args, arm))
    check_same_comparison(args)
    with hold_folder(args.out_dir):  # one command per comparison: a second would retrain the running arm
        for arm in ARMS:
            train(args, arm)
        for arm in ARMS if tasks else ():
            evaluate_downstream(args, arm, tasks)
        text = table(args, tasks)
        with open(os.path.join(args.out_dir, "table.md"), "w") as f:
            f.write(text)
    print("\n" + text + f"\n(written to {os.path.join(args.out_dir, 'table.md')})")


if __name__ == "__main__":
    sys.exit(run_main(compare, sys.argv[1:]))
