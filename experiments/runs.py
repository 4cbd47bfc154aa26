"""The one way the experiments run train.py and read its run folders: the command, starting and stopping
it, a run's config, log and last evaluation, whether runs read the same data, and the markdown tables
every tool prints of them (`markdown`, `side_by_side`).

compare.py and study.py train run folders to their end (`finished`, `train`); bench.py starts
several runs together and waits for each (`start`, `wait`, `stop`). Every run is a subprocess in
a session of its own, so that a signal sent to it reaches torchrun's workers too. A run stopped
at a deadline, on Ctrl-C or on a SIGTERM to its caller gets SIGTERM unless the caller says otherwise: train.py then saves a
checkpoint and exits, and `--resume` continues it.
"""
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from experiments.cli import read_json
from prepare_data import UserError, hold_folder, open_prepared
from train import RESUME_FREE, RUN_FILES, read_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TRAIN = os.path.join(ROOT, "train.py")  # absolute: the run folders' paths stay relative to the caller's folder
PREPARE_DATA = os.path.join(ROOT, "prepare_data.py")
EVALUATION = re.compile(r"eval_step(\d+)\.json")  # train.py's evaluation at a step, by its file's whole name


def log_records(run_dir, kind):
    """The records of one type ("train" or "eval") in a run's log.jsonl, in order; [] if it has none. A last
    line cut by a kill is left out; any other damaged one is refused, as the tables read from it would be wrong."""
    path = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")[:-1]  # what follows the last newline is a cut line, or nothing
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and record.get("type") in ("train", "eval")
                and isinstance(record.get("step"), int)):
            raise UserError(f"{path}, line {number}: not a log record (damaged or edited); delete it and run again")
        records.append(record)
    return [r for r in records if r["type"] == kind]


def error_line(output):
    """What a failed run said: train.py's one `error:` line, else the first line naming an exception
    (a worker's, before torchrun's own; [rankN]: prefixes dropped), else its last line."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in output.strip().splitlines()] or ["no output"]
    return next((line for line in lines if line.startswith("error:")), None) or next(
        (line for line in lines if re.match(r"\w+(\.\w+)*(Error|Exception)\b", line)), lines[-1])


def read_config(run_dir):
    """A run's config.json: train.py's options (train), the model's shape (model), the data it read (data)."""
    return read_json(os.path.join(run_dir, "config.json"), "delete the run folder to train it afresh")


def last_evaluation(run_dir):
    """The eval_step{N}.json of the run's last evaluation, or None before the first."""
    # train.py's own files only: a copy a user made beside them ("eval_step4 (copy).json") is not one
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    steps = [int(m[1]) for name in names if (m := EVALUATION.fullmatch(name))]
    if not steps:
        return None
    path = os.path.join(run_dir, f"eval_step{max(steps)}.json")
    return read_json(path, f"delete it and evaluate again: python train.py --eval_only --out_dir={run_dir}")


def finished(run_dir, options=None):
    """Whether the run has evaluated at its last step (train.py's last act before exiting). With the
    train.py options it is to have (train.py's own, read_options'), a finished run trained
    otherwise is refused: reused, its results would stand for a run never made (a hand-made one)."""
    config_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(config_path):
        return False
    config = read_config(run_dir)
    total_tokens = config.get("train", {}).get("total_tokens") if isinstance(config, dict) else None
    if not isinstance(total_tokens, int):
        raise UserError(f"{config_path} lacks the run's total_tokens (an edited or foreign file); "
                        "delete the run folder to train it afresh")
    records = log_records(run_dir, "eval")
    done = bool(records) and records[-1]["tokens_seen"] >= total_tokens
    if done and options is not None:
        asked, saved = vars(read_options(options)), config["train"]
        if changed := sorted(k for k in asked if k not in RESUME_FREE and saved.get(k) != asked[k]):
            raise UserError(f"{run_dir} was trained with other options (" + ", ".join(
                f"{k}={saved.get(k)} there, {asked[k]} here" for k in changed) + "): delete it to train it "
                "with these, or ask for the options it was trained with")
        if config.get("data") != open_prepared(asked["data_dir"])[4]:  # the data prepared again since
            raise UserError(f"{run_dir} records other data than {asked['data_dir']} holds now (prepared again "
                            "since, or an older train.py's run): delete it to train it on this data")
    return done


def check_same_data(run_dirs):
    """Refuse to put together runs that read different data (config.json's "data": each shard's length
    and the crc32 of its start, as train.py recorded them): side by side, their figures would differ by
    the data as well as by what the table says."""
    data = [read_config(d).get("data") for d in run_dirs]
    for run_dir, its_data in zip(run_dirs, data):
        if its_data != data[0]:
            raise UserError(f"{run_dirs[0]} and {run_dir} were trained on different data: train them again on "
                            "one prepared folder")


def command(options, processes=1, observed=None, module=None):
    """train.py with options; more than one process runs under torchrun (DDP, one GPU each). With
    observed, a JSON file: run by experiments.observe, which writes there what torch did in it. With
    module, `-m module` in train.py's place (experiments.lev_variants: train.py's main, LEV replaced)."""
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
                if processes > 1 else [])
    observer = ["-m", "experiments.observe", observed] if observed else []  # torchrun's -m too
    return [sys.executable, *launcher, *observer, *(["-m", module] if module else [TRAIN]), *options]


def start(options, processes=1, output=None, env=None, observed=None, module=None):
    """Start train.py (command()) in a session of its own, with env's variables over this process's; its
    output appended to the file `output`, or to this terminal when None."""
    argv, env = command(options, processes, observed, module), {**os.environ, **(env or {})}
    if output is None:
        return subprocess.Popen(argv, start_new_session=True, env=env)
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    with open(output, "a") as f:  # the child has its own copy of the file
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)


def descendants(pid):
    """The processes pid started, and theirs: torchrun starts each worker in a session of its own, which a
    signal to torchrun's session does not reach. Read from every /proc/<pid>/stat's parent field (the
    standard library, any Linux kernel); [] where there is no /proc."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():  # self, thread-self, and what is not a process
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it has ended
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (name) state"; a name may hold ")"
        children.setdefault(parent, []).append(int(entry))
    found, unseen = [], [pid]
    while unseen:
        found_now = children.get(unseen.pop(), [])
        found += found_now
        unseen += found_now
    return found


def signal_run(pid, stop_signal):
    """Send stop_signal to the session of the run started as pid, and to its workers (in sessions of their own)."""
    workers = descendants(pid)  # before torchrun ends: its workers would be orphans then
    with contextlib.suppress(ProcessLookupError):  # it ended in between
        os.killpg(pid, stop_signal)
    for worker in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, stop_signal)


def stop(process, stop_signal=signal.SIGTERM):
    """Send stop_signal to a run's whole session and its workers', if it is still going, and wait for it to
    end. SIGTERM lets train.py save a checkpoint; SIGKILL ends a run that hangs (in a collective)."""
    if process.poll() is None:
        signal_run(process.pid, stop_signal)
    process.wait()


def exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def wait(process, deadline=None, stop_signal=signal.SIGTERM):
    """(exit status, whether it was stopped) of a started run: stopped with stop_signal at the
    deadline (time.time() seconds; None: none), and on Ctrl-C or SIGTERM here (`kill`, a job's
    end), which in its own session it does not receive."""
    previous = signal.signal(signal.SIGTERM, exit_on_signal)  # SIGTERM here becomes SystemExit(143)
    try:
        return process.wait(timeout=None if deadline is None else max(0.0, deadline - time.time())), False
    except subprocess.TimeoutExpired:
        stop(process, stop_signal)
        return process.returncode, True
    except BaseException:  # Ctrl-C, SIGTERM, or an error here: the run must not go on alone
        stop(process, stop_signal)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def shown(argv):
    """A command() as a user would type it here."""
    return shlex.join(["python", *(os.path.relpath(a) if a == TRAIN else a for a in argv[1:])])


def train(run_dir, options, processes=1, output=None, deadline=None, note="", module=None):
    """Train into run_dir, resumed from its checkpoint where it has one; print the command first
    (then `note`). Callers skip a finished run: `finished`. Returns wait()'s (exit status, stopped)."""
    options = [*options, f"--out_dir={run_dir}"]
    if os.path.exists(os.path.join(run_dir, "ckpt.pt")):
        options.append("--resume")
    elif os.path.isdir(run_dir):  # stopped before its first checkpoint, nothing to resume: its files go
        # (train.py refuses to start over them), and its evaluations, which would stand beside the new
        # run's; not while the run is still going there (the command that started it killed alone)
        with hold_folder(run_dir):
            for name in os.listdir(run_dir):
                if name in RUN_FILES or EVALUATION.fullmatch(name):
                    os.remove(os.path.join(run_dir, name))
    print(f"{time.strftime('%H:%M')} {shown(command(options, processes, module=module))}{note}", flush=True)
    return wait(start(options, processes, output, module=module), deadline)


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
    """The comparison table (evaluate.py --compare, compare.py, study.py's buckets) as markdown lines: per
    row its label cells, each name's cell, focus's relative difference to each other name (none without
    focus among names), then the extra cells. rows: [(label cells, {name: (value, cell)}, extra cells)];
    a value of None has no difference."""
    others = [name for name in names if name != focus] if focus in names else []
    header = [*labels, *names, *(f"{focus} vs {name}" for name in others), *extra]
    body = [[*label_cells, *(values[name][1] for name in names),
             *(relative(values[focus][0], values[name][0]) for name in others), *extra_cells]
            for label_cells, values, extra_cells in rows]
    return markdown(header, body, len(labels))
