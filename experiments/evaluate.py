"""Downstream evaluation of a trained run through EleutherAI's lm-evaluation-harness.

    python -m experiments.evaluate --out_dir=out/1.2b-lev             # the six default benchmarks
    python -m experiments.evaluate --out_dir=out/1.2b-lev --tasks=lambada_openai,piqa --limit=100
    python -m experiments.evaluate --out_dir=out/tiny-lev --tasks=my_task --include_path=my_tasks/
    python -m experiments.evaluate --compare out/1.2b-lev out/1.2b-tied   # arms side by side

lm-eval is optional (pip install "lm-eval>=0.4.10,<0.5"): it downloads each benchmark
from the Hugging Face Hub the first time. The default six are our choice, since the paper
does not name its six: LAMBADA (OpenAI version, perplexity and accuracy), HellaSwag, PIQA,
ARC-Easy, ARC-Challenge and WinoGrande, the zero-shot suite reported for Pile-trained
models of this size (e.g. by the Mamba paper). It includes LAMBADA, whose perplexity the
paper quotes, and every one is scored by log-likelihood, so no text is generated.

How our model answers lm-eval (the LeviathanLM adapter below):
- Text is encoded with the run's own tokenizer and conditioned on end-of-text: in the
  training stream every document follows one, so that is where a new text starts.
- At most seq_len tokens of context: longer contexts lose their oldest tokens, and long
  texts are scored in windows, each token once, each window with as much context as fits.
- Requests are batched longest first, so rows of a batch have similar lengths; the
  padding that evens them out comes after the real tokens, where causal attention keeps
  it out of their view, and it is never scored.
- Padding ids of the vocabulary (rounded up to a multiple of 128) are excluded from every
  softmax: the tokenizer cannot produce them, so they must not take probability mass.
"""
import argparse, glob, logging, os, sys
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.evaluate")

import torch

from experiments.cli import read_json, run_main
from leviathan import precision
from prepare_data import UserError, hold_folder, write_json
from sample import load_model

try:
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager
except ImportError:  # main() says how to install it; the adapter's arithmetic needs only torch
    lm_eval, LM, TaskManager = None, object, None

INSTALL = 'pip install "lm-eval>=0.4.10,<0.5"'  # 0.4.10 and 0.4.13 tested; 0.4.10 dropped transformers
DEFAULT_TASKS = ["lambada_openai", "hellaswag", "piqa", "arc_easy", "arc_challenge", "winogrande"]
RESULTS_FILE = "downstream.json"


# ---------------------------------------------------------------------------- the adapter


def scoring_windows(prefix, scored, seq_len):
    """Windows [(tokens, n)] that together score every id of `scored` once, given `prefix`:
    tokens[:-1] is the model's input, and the last n of tokens[1:] are scored. Each window
    scores up to seq_len ids and is filled on the left with as much context as fits."""
    tokens = prefix + scored
    windows = []
    for first in range(len(prefix), len(tokens), seq_len):
        end = min(first + seq_len, len(tokens))
        windows.append((tokens[max(0, end - seq_len - 1):end], end - first))
    return windows


class LeviathanLM(LM):
    """Our Model behind lm-eval's model interface: log-likelihoods of text, no generation."""

    def __init__(self, model, tokenizer, batch_size=16, bf16=None):
        super().__init__()
        self.model, self.tokenizer, self.batch_size, self.bf16 = model, tokenizer, batch_size, bf16
        self.seq_len = model.cfg.seq_len
        self._device = model.head.weight.device

    def loglikelihood(self, requests):
        """(context, continuation) -> (log p(continuation | context), is it the greedy choice)."""
        windows_per_request = []
        for request in requests:
            context, continuation = request.args
            # BPE attaches a space to the word after it, so a context's trailing spaces
            # belong to the continuation: a lone final space is a token training rarely saw.
            stripped = context.rstrip(" ")
            windows_per_request.append(self._windows(stripped, context[len(stripped):] + continuation))
        return self._score(windows_per_request)

    def loglikelihood_rolling(self, requests):
        """(text,) -> log p(text) from a document start, for perplexities of whole texts."""
        scores = self._score([self._windows("", request.args[0]) for request in requests])
        return [logprob for logprob, _ in scores]

    def _windows(self, context, text):
        """The windows that score `text` after end-of-text and `context`."""
        prefix = [self.tokenizer.eot_token] + self.tokenizer.encode_ordinary(context)
        return scoring_windows(prefix, self.tokenizer.encode_ordinary(text), self.seq_len)

    def generate_until(self, requests):
        tasks = sorted({str(request.task_name) for request in requests})
        raise UserError(f"{', '.join(tasks)} needs generated text, which this adapter does not "
                        "produce; choose tasks scored by log-likelihood (multiple choice, perplexity)")

    def _score(self, windows_per_request):
        """Sum the log-probs of every request's windows; greedy if every scored id was the argmax."""
        windows = [(i, window) for i, ws in enumerate(windows_per_request) for window in ws]
        totals = [[0.0, True] for _ in windows_per_request]
        windows.sort(key=lambda item: -len(item[1][0]))  # longest first: an out-of-memory shows at once
        for start in range(0, len(windows), self.batch_size):
            batch = windows[start:start + self.batch_size]
            for (i, _), (logprob, greedy) in zip(batch, self._score_batch([window for _, window in batch])):
                totals[i][0] += logprob
                totals[i][1] &= greedy
        return [(logprob, greedy) for logprob, greedy in totals]

    @torch.no_grad()
    def _score_batch(self, windows):
        width = max(len(tokens) for tokens, _ in windows) - 1
        inputs = torch.full((len(windows), width), self.tokenizer.eot_token, dtype=torch.long)
        for row, (tokens, _) in enumerate(windows):
            inputs[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
        with precision(self._device, self.bf16):  # the training precision
            logits = self.model(inputs.to(self._device))  # [B, T, V], float32
        scores = []
        for row, (tokens, n) in enumerate(windows):
            # logits at input position p predict tokens[p + 1]; keep the last n real positions,
            # and only the columns of ids the tokenizer has (the rest are padding).
            end = len(tokens) - 1
            logprobs = logits[row, end - n:end, :self.tokenizer.n_vocab].log_softmax(-1)
            targets = torch.tensor(tokens[-n:], device=logprobs.device)
            logprob = logprobs.gather(1, targets[:, None]).sum().item()
            scores.append((logprob, bool((logprobs.argmax(-1) == targets).all())))
        return scores


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


def markdown(header, rows, labels):
    """Lines of a markdown table padded to line up in a terminal too: the first `labels` columns
    flush left, the figures after them flush right."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(header))]

    def line(row):
        return "| " + " | ".join(c.ljust(w) if i < labels else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))) + " |"
    rule = "|" + "|".join("-" * (w + 2) if i < labels else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return [line(cells[0]), rule] + [line(row) for row in cells[1:]]


def relative(value, base):
    return "-" if value is None or not base else f"{value / base - 1:+.1%}"


def side_by_side(labels, names, focus, rows, extra=()):
    """The comparison table (evaluate.py --compare, compare.py) as markdown lines: per row its label
    cells, each name's cell, focus's relative difference to each other name, then the extra cells.
    rows: [(label cells, {name: (value, cell)}, extra cells)]; a value of None has no difference."""
    others = [name for name in names if name != focus]
    header = [*labels, *names, *(f"{focus} vs {name}" for name in others), *extra]
    body = [[*label_cells, *(values[name][1] for name in names),
             *(relative(values[focus][0], values[name][0]) for name in others), *extra_cells]
            for label_cells, values, extra_cells in rows]
    return markdown(header, body, len(labels))


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
    parser.add_argument("--out_dir", help="run folder holding ckpt.pt; the results go there too")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated lm-eval task names")
    parser.add_argument("--include_path", help="a folder of your own lm-eval YAML tasks")
    parser.add_argument("--limit", type=int, help="only the first N examples of each task (a quick look)")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="windows of up to seq_len tokens per forward pass (lower it if out of memory)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction,
                        help="bf16 autocast, as in training (default: on for CUDA, off for CPU)")
    parser.add_argument("--compare", nargs="+", metavar="RUN", help="print these runs' results side by side")
    args = parser.parse_args(argv)
    if (args.out_dir is None) == (args.compare is None):
        raise UserError("pass --out_dir=RUN to evaluate, or --compare RUN RUN... to compare")
    if args.compare is not None and (len(args.compare) < 2 or len(set(args.compare)) < len(args.compare)):
        raise UserError("--compare needs at least two run folders, each once")
    if args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise UserError("--limit and --batch_size must be at least 1")
    return args


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
    """lm-eval's TaskManager, once every task is known to it: checked before a model is loaded or
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
    """A --device this machine cannot use, as one line, before any time is spent on the tasks."""
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as error:  # AssertionError: a torch built without CUDA
        reason = str(error).splitlines()[0]
        raise UserError(f"device {name!r} is not usable here: {reason}") from None


def evaluate(args):
    if lm_eval is None:
        raise UserError(f"experiments.evaluate needs EleutherAI's lm-evaluation-harness: {INSTALL}")
    check_device(args.device)
    # Results accumulate by task, so a quick --limit look at one task keeps the others' full runs; the
    # file is read (and checked) now, not after an hour of evaluation.
    path = os.path.join(args.out_dir, RESULTS_FILE)
    saved = read_results(args.out_dir) if os.path.exists(path) else {}
    tasks = [t for t in args.tasks.split(",") if t]
    check_limit(saved, tasks, args.limit, path)
    manager = task_manager(tasks, args.include_path)  # the tasks before the model: each error as early as it can be
    model, tokenizer, step = load_model(args.out_dir, args.device)
    model.freeze_lev()  # LEV depends only on the id: evaluate it once, then look it up
    with hold_folder(args.out_dir):  # one process per run folder: two evaluations would keep one's results
        saved = read_results(args.out_dir) if os.path.exists(path) else {}  # again, now that it is ours
        adapter = LeviathanLM(model, tokenizer, args.batch_size, args.bf16)
        # Out of the Hub's reach, its client retries each request with a warning per try: the error says it once
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
        try:
            output = lm_eval.simple_evaluate(model=adapter, tasks=tasks, task_manager=manager,
                                             limit=args.limit, log_samples=False)
        except OSError as e:  # datasets' ConnectionError, DatasetNotFoundError, a missing local file
            raise UserError(f"could not load a task's data ({e}); lm-eval downloads each benchmark "
                            "from the Hugging Face Hub the first time, then reads its cache")
        except torch.cuda.OutOfMemoryError:
            raise UserError(f"out of memory on {args.device} at --batch_size={args.batch_size}; lower it")
        rows = result_rows(output["results"])
        table = [(task, metric, number(value), number(stderr)) for task, metric, value, stderr in rows]
        print("\n".join(markdown(["task", "metric", "value", "stderr"], table, labels=2)))
        for task in output["results"]:
            saved[task] = {"step": step, "limit": args.limit, "lm_eval_version": output.get("lm_eval_version"),
                           "samples": output["n-samples"].get(task, {}).get("effective"),
                           "metrics": {m: [v, s] for t, m, v, s in rows if t == task}}
        write_json(path, saved)
        print(f"# written to {path}", file=sys.stderr)


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
