"""Downstream evaluation of a trained run: its transformers export, scored by lm-eval's own `hf` model.

    python -m experiments.evaluate --out_dir=out/1.2b-lev             # the six default benchmarks
    python -m experiments.evaluate --out_dir=out/1.2b-lev --tasks=lambada_openai,piqa --limit=100
    python -m experiments.evaluate --out_dir=out/tiny-lev --tasks=my_task --include_path=my_tasks/
    python -m experiments.evaluate --compare out/1.2b-lev out/1.2b-tied   # arms side by side

The run is exported (experiments.export) into <out_dir>/hf, which is kept while ckpt.pt is the one it
was made from and made again when it changes. lm-eval's `hf` model loads that folder with
add_bos_token=True: each context starts with end-of-text, as every document follows one in training.
The results (downstream.json in the run folder) are what a user gets by hand from
    lm_eval --model hf --model_args pretrained=out/1.2b-lev/hf,add_bos_token=True,dtype=float32 --tasks piqa

lm-eval, transformers and accelerate are optional (INSTALL below); lm-eval downloads each
benchmark from the Hugging Face Hub the first time. The default six are our choice, since the paper
does not name its six: LAMBADA (OpenAI version, perplexity and accuracy), HellaSwag, PIQA, ARC-Easy,
ARC-Challenge and WinoGrande, the zero-shot suite reported for Pile-trained models of this size (e.g.
by the Mamba paper). It includes LAMBADA, whose perplexity the paper quotes.
"""
import argparse, glob, importlib.util, logging, os, sys
from types import SimpleNamespace
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.evaluate")

import torch

from experiments import export
from experiments.runs import markdown, side_by_side
from experiments.cli import read_json, run_main
from prepare_data import UserError, hold_folder, write_json

try:
    import lm_eval
    from lm_eval.tasks import TaskManager
except ImportError:  # evaluate() says how to install it
    lm_eval = TaskManager = None
if not all(importlib.util.find_spec(name) for name in ("transformers", "accelerate")):  # the hf model's
    lm_eval = TaskManager = None

INSTALL = 'pip install "lm-eval>=0.4.10,<0.5" "transformers>=5,<6" accelerate'  # lm-eval 0.4.10, 0.4.13 tested
DEFAULT_TASKS = ["lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande"]
RESULTS_FILE = "downstream.json"
HF_DIR = "hf"  # the export's folder inside the run


# ---------------------------------------------------------------------------- the export and lm-eval


def up_to_date_export(out_dir):
    """<out_dir>/hf, exported again unless it was made from the ckpt.pt there now (its size and time)."""
    hf_dir = os.path.join(out_dir, HF_DIR)
    ckpt = os.stat(os.path.join(out_dir, "ckpt.pt"))
    made_from = [ckpt.st_size, ckpt.st_mtime_ns]
    config, fix = os.path.join(hf_dir, "config.json"), "delete that folder: it is made again"
    made = read_json(config, fix).get(export.MARK, {}) if os.path.exists(config) else {}  # the export's entry
    if made.get("checkpoint") != made_from:
        export.export(SimpleNamespace(out_dir=out_dir, hf_dir=hf_dir, tokenizer=True))
        made = read_json(config, fix)[export.MARK]
    if not os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        raise UserError(f"{hf_dir} has no tokenizer (the export found none exact for the run's), "
                        "which lm-eval needs")
    return hf_dir, made["step"]


def evaluate(args):
    if lm_eval is None:
        raise UserError(f"experiments.evaluate needs EleutherAI's lm-evaluation-harness: {INSTALL}")
    # Results accumulate by task, so a quick --limit look at one task keeps the others' full runs; the
    # file is read (and checked) now, not after an hour of evaluation.
    path = os.path.join(args.out_dir, RESULTS_FILE)
    saved = read_results(args.out_dir) if os.path.exists(path) else {}
    tasks = [t for t in args.tasks.split(",") if t]
    check_limit(saved, tasks, args.limit, path)
    manager = task_manager(tasks, args.include_path)  # the tasks and the device before the export:
    check_device(args.device)  # each error before minutes of exporting
    os.stat(os.path.join(args.out_dir, "ckpt.pt"))  # a folder without a run: named before it is locked
    with hold_folder(args.out_dir):  # one process per run folder: two evaluations would keep one's results
        hf_dir, step = up_to_date_export(args.out_dir)
        saved = read_results(args.out_dir) if os.path.exists(path) else {}  # again, now that it is ours
        # Out of the Hub's reach, its client retries each request with a warning per try: the error says it once
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
        model_args = dict(pretrained=hf_dir, add_bos_token=True, dtype=args.dtype)
        try:
            output = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, task_manager=manager,
                                             device=args.device, batch_size=args.batch_size, limit=args.limit)
        except OSError as e:  # datasets' ConnectionError, DatasetNotFoundError, a missing local file
            raise UserError(f"could not load a task's data ({e}); lm-eval downloads each benchmark "
                            "from the Hugging Face Hub the first time, then reads its cache")
        rows = result_rows(output["results"])
        table = [(task, metric, number(value), number(stderr)) for task, metric, value, stderr in rows]
        print("\n".join(markdown(["task", "metric", "value", "stderr"], table, labels=2)))
        for task in output["results"]:
            saved[task] = {"step": step, "limit": args.limit, "lm_eval_version": output.get("lm_eval_version"),
                           "samples": output["n-samples"].get(task, {}).get("effective"),
                           "metrics": {m: [v, s] for t, m, v, s in rows if t == task}}
        write_json(path, saved)
        print(f"# written to {path}", file=sys.stderr)


def check_limit(saved, tasks, limit, path):
    """A task's saved result and a new one must cover the same examples: a --limit look over a full
    evaluation (or the reverse) would replace one with the other unseen."""
    def examples(n):
        return "every example" if n is None else f"--limit={n}"
    for task in tasks:
        if task in saved and (there := saved[task].get("limit")) != limit:
            raise UserError(f"{path} holds {task} evaluated on {examples(there)}, this run asks for "
                            f"{examples(limit)}: pass the same --limit, or move the file aside")


def check_device(name):
    """A --device this machine cannot use, as one line."""
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as error:  # AssertionError: a torch built without CUDA
        reason = str(error).splitlines()[0]
        raise UserError(f"device {name!r} is not usable here: {reason}") from None


def check_yaml(include_path):
    """Every YAML file under include_path parses: lm-eval skips one that does not with a log line,
    and its task would then be reported unknown. Tags (lm-eval's !function) are not resolved here."""
    import yaml  # lm-eval's own dependency
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda *_: None)
    for path in sorted(glob.glob(os.path.join(include_path, "**", "*.y*ml"), recursive=True)):
        try:
            with open(path, encoding="utf-8") as f:
                yaml.load(f, loader)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not valid YAML ({str(e).splitlines()[0]}); fix it or remove it "
                            "from --include_path") from None


def task_manager(tasks, include_path):
    """lm-eval's TaskManager, once every task is known to it: checked before a model is exported or
    trained (compare.py), not after."""
    if include_path:
        if not os.path.isdir(include_path):
            raise UserError(f"--include_path {include_path} is not a folder")
        check_yaml(include_path)
    manager = TaskManager(include_path=include_path)  # indexes every task: the slow part of start-up
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown or not tasks:
        raise UserError(f"unknown task {', '.join(unknown) or '(none given)'}: lm-eval knows "
                        f"{len(manager.all_tasks)} (lm-eval ls tasks lists them); "
                        "your own YAML tasks need --include_path")
    return manager


# ---------------------------------------------------------------------------- results


def result_rows(results):
    """lm-eval's {task: {"acc,none": v, "acc_stderr,none": s, ...}} -> [(task, metric, value, stderr)]."""
    rows = []
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if filter_name and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                stderr = metrics.get(f"{metric}_stderr,{filter_name}")
                rows.append((task, metric, value, stderr if isinstance(stderr, (int, float)) else None))
    return rows


def number(value):
    return "-" if value is None else f"{value:,.2f}" if abs(value) >= 100 else f"{value:.4f}"


def read_results(out_dir):
    """downstream.json: {task: {"metrics": {metric: [value, stderr]}, ...}}, checked as it is read."""
    path = os.path.join(out_dir, RESULTS_FILE)
    try:
        results = read_json(path, "move it aside to start its results afresh")
    except FileNotFoundError:
        raise UserError(f"no {path}; run python -m experiments.evaluate --out_dir={out_dir} first") from None
    if not (isinstance(results, dict) and all(isinstance(entry, dict) and isinstance(entry.get("metrics"), dict)
                                              for entry in results.values())):
        raise UserError(f"{path} is not a results file of experiments.evaluate: move it aside to start afresh")
    return results


def compare(out_dirs):
    """One row per (task, metric) present in every run; the first run relative to each other one.
    A task evaluated on other examples in one run (--limit) is refused; each run's steps are printed."""
    results = {d: read_results(d) for d in out_dirs}
    rows = []
    for task, entry in results[out_dirs[0]].items():
        limits = {d: r[task].get("limit") for d, r in results.items() if task in r}
        if len(set(limits.values())) > 1:
            raise UserError(f"{task} was evaluated on other examples in each run (--limit: " + ", ".join(
                f"{limit or 'none'} in {d}" for d, limit in limits.items()) + "): evaluate it alike in each")
        for metric in entry["metrics"]:
            found = {d: r.get(task, {}).get("metrics", {}).get(metric) for d, r in results.items()}
            if None not in found.values():
                cells = {d: (value, f"{number(value)} ± {number(stderr)}") for d, (value, stderr) in found.items()}
                rows.append(([task, metric], cells, []))
    if not rows:
        raise UserError(f"{', '.join(out_dirs)} have no task and metric in common")
    print("\n".join(side_by_side(["task", "metric"], out_dirs, out_dirs[0], rows)))
    steps = {d: sorted({entry.get("step") for entry in r.values()}, key=str) for d, r in results.items()}
    print("checkpoint steps: " + "; ".join(f"{d} {', '.join(map(str, s))}" for d, s in steps.items()))


# ---------------------------------------------------------------------------- command line


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m experiments.evaluate", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --out_dir=RUN [--name=value]", allow_abbrev=False)
    parser.add_argument("--out_dir", help="run folder holding ckpt.pt; the export and the results go there too")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated lm-eval task names")
    parser.add_argument("--include_path", help="a folder of your own lm-eval YAML tasks")
    parser.add_argument("--limit", type=int, help="only the first N examples of each task (a quick look)")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="sequences per forward pass (lower it if out of memory)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the exported model's weights and arithmetic (bfloat16: faster on a GPU)")
    parser.add_argument("--compare", nargs="+", metavar="RUN", help="print these runs' results side by side")
    args = parser.parse_args(argv)
    if (args.out_dir is None) == (args.compare is None):
        raise UserError("pass --out_dir=RUN to evaluate, or --compare RUN RUN... to compare")
    if args.compare is not None and (len(args.compare) < 2 or len(set(args.compare)) < len(args.compare)):
        raise UserError("--compare needs at least two run folders, each once")
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--limit and --batch_size must be at least 1")
    return args


def evaluate_or_compare(argv):
    args = parse_args(argv)
    if args.compare:
        compare(args.compare)
    else:
        evaluate(args)


def main(argv=None):
    return run_main(evaluate_or_compare, argv)


if __name__ == "__main__":
    sys.exit(main())
