"""What the tests under tests/ share: the repository on sys.path, scripts run as a user runs them,
and a prepared corpus (one per session). The model's own tests and helpers are ../test_leviathan.py."""
import json
import os
import random
import struct
import subprocess
import sys
import zipfile

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, HERE)

from test_leviathan import EOT, META, MICRO, N_VALID, micro_model, random_model  # noqa: E402,F401

# Scripts run with one OpenMP thread: the models are tiny, and test processes then do not fight
# for cores. The exactness tests use two threads (THREADED), so that they show what holds with several.
SCRIPT_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE, "PYTHONIOENCODING": "utf-8"}
THREADED = {"OMP_NUM_THREADS": "2"}


def run_script(script, *args, env=None, launcher=(), timeout=300, cwd=HERE):
    """`python [launcher] SCRIPT ARGS` in the repository (or cwd), as a user runs it; stdout and stderr as text."""
    return subprocess.run([sys.executable, *launcher, os.path.join(HERE, script), *map(str, args)], cwd=cwd,
                          env={**SCRIPT_ENV, **(env or {})}, capture_output=True, text=True, encoding="utf-8",
                          timeout=timeout)


def assert_one_error_line(code, err, *phrases):
    """A refused input: non-zero exit, no traceback, one `error:` line on stderr holding every phrase."""
    lines = err.strip().splitlines()
    assert code != 0 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


def exit_status(main, argv):
    """main(argv) as the script's exit status, argparse's SystemExit included (a mistake on the command line)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def assert_usage_error(code, err, prog, *phrases):
    """A command line argparse refuses: status 2, its usage line, then one `PROG: error:` line holding each phrase."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 2 and lines[0].startswith("usage: ") and lines[1].startswith(f"{prog}: error: "), err
    for phrase in phrases:
        assert phrase in lines[1], (phrase, lines[1])


# A train.py run of seconds: a micro model (the size's other settings) on a 512-id corpus.
TRAIN_ARGS = ["--size=tiny", "--d_model=32", "--n_layer=1", "--n_head=2", "--seq_len=32", "--lev_seed_dim=16",
              "--lev_heads=2", "--lev_knots=4", "--lev_rank=8", "--batch_tokens=512", "--micro_batch=8",
              "--lr=3e-3", "--warmup_steps=5", "--eval_tokens=2048", "--log_interval=1", "--device=cpu"]


def prepare_corpus(tmp, name, vocab_size):
    """A corpus with learnable structure: sentences from a small grammar, 300 documents."""
    rng = random.Random(0)
    words = {"who": ["the cat", "a dog", "my friend", "the old man", "Alice"],
             "does": ["sat on", "looked at", "walked to", "found", "liked"],
             "what": ["the mat", "a red ball", "the garden", "some bread", "the river"]}
    with open(tmp / f"{name}.jsonl", "w") as f:
        for _ in range(300):
            text = " ".join(" ".join(rng.choice(words[k]) for k in words) + "." for _ in range(30))
            f.write(json.dumps({"text": text}) + "\n")
    out = tmp / f"data_{name}"
    r = run_script("prepare_data.py", f"--dataset={tmp / name}.jsonl", f"--out_dir={out}",
                   f"--vocab_size={vocab_size}", "--val_fraction=0.1", "--workers=1")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def train_data(tmp_path_factory):
    return prepare_corpus(tmp_path_factory.mktemp("train"), "corpus", 512)


def damage(checkpoint):
    """Flip one bit in the middle of the largest record of a checkpoint (a tensor's bytes), as a failing disk
    or a bad copy would: the file still loads with torch.load."""
    with zipfile.ZipFile(checkpoint) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(open(checkpoint, "rb").read())
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_length + extra_length + record.file_size // 2] ^= 1
    open(checkpoint, "wb").write(bytes(data))


def train_cli(train_data, out, *args, nproc=1, check=True, env=None):
    """train.py on train_data into out, with TRAIN_ARGS; under torchrun with nproc processes."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    r = run_script("train.py", f"--data_dir={train_data}", f"--out_dir={out}", *TRAIN_ARGS, *args,
                   env=env, launcher=launcher)
    if check and r.returncode != 0:
        raise AssertionError(f"train.py failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def logged_losses(out):
    """{step: (loss, lr)} of the training lines in out/log.jsonl."""
    records = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    return {r["step"]: (r["loss"], r["lr"]) for r in records if r["type"] == "train"}


def write_choice_task(folder, docs):
    """A multiple-choice lm-eval task over a local JSONL file: nothing is downloaded."""
    folder.mkdir()
    with open(folder / "docs.jsonl", "w") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    (folder / "local_choice.yaml").write_text(
        "task: local_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'docs.jsonl'))}\n"
        "output_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder
