"""Sample text from a trained Leviathan run.

    python sample.py --out_dir=RUN                       # a new document, from end-of-text
    python sample.py --out_dir=RUN --prompt="The river" --num_samples=3 --temperature=0.8 --top_p=0.95
    python sample.py --out_dir=RUN --prompt_file=prompt.txt --temperature=0 --stop_at_eot=false

Inference choices, each explained where it is made below:
- LEV is evaluated once for the whole vocabulary (model.freeze_lev()): a lookup table.
- A KV cache: each new token costs one position of compute. When the context reaches the
  model's seq_len, the last seq_len // 2 tokens are kept and re-read into a fresh cache.
- Padding ids (the vocabulary rounded up to a multiple of 128) are never sampled.
"""
import math, os, sys, time, zipfile
from contextlib import nullcontext

import torch

from leviathan import Config, Model, generate
from prepare_data import ArgumentParser, UserError, parse_bool, parse_number, run_main, tokenizer_from_meta

# ---------------------------------------------------------------------------- a trained model from its checkpoint


def load_checkpoint(path, keys=("model", "model_config", "data_meta")):
    """A train.py checkpoint, checked to hold `keys`. Always onto the CPU, whatever device saved
    it: each rank copies only the weights into its own GPU.
    Memory-mapped: only the tensors used are read, and ranks on one node share one copy."""
    if not zipfile.is_zipfile(path):  # torch.save's format: an empty, cut-short or foreign file is no zip
        size = os.path.getsize(path)
        what = "it is empty" if size == 0 else f"its {size:,} bytes are not in torch.save's format"
        raise UserError(f"{path} is not a checkpoint ({what}): a save cut short, or another file; "
                        "use another --out_dir, or train again")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a damaged zip, or pickled objects
        reason = str(e).splitlines()[0][:200]
        raise UserError(f"could not read {path} ({type(e).__name__}: {reason}); is it a train.py checkpoint?") from None
    missing = [key for key in keys if not isinstance(ckpt, dict) or key not in ckpt]
    if missing or not isinstance(ckpt["model"], dict):
        raise UserError(f"{path} is not a train.py checkpoint (it lacks {', '.join(missing or ['model'])})")
    return ckpt


def check_state_dict(model, state, path):
    """Explain a mismatch in one line instead of load_state_dict's multi-line report."""
    want = model.state_dict()
    found = {"missing": [k for k in want if k not in state],
             "unexpected": [k for k in state if k not in want],
             "shapes differ:": [f"{k} {list(state[k].shape)} (code wants {list(v.shape)})"
                                for k, v in want.items() if k in state and state[k].shape != v.shape]}
    problems = [f"{what} {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                for what, names in found.items() if names]
    if problems:
        raise UserError(f"{path}: the weights do not fit the model its model_config describes "
                        f"({'; '.join(problems)}); was it written by another version of leviathan.py?")


def load_model(out_dir, device="cpu"):
    """A run's model in eval mode, the tokenizer of its data, and its step. For inference, call
    model.freeze_lev() once every other check has passed (slow for a large vocabulary on a CPU)."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isdir(out_dir):
        raise UserError(f"run folder {out_dir} not found; pass --out_dir=RUN, the folder train.py wrote")
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint {path}; train first (python train.py), or pick another --out_dir")
    ckpt = load_checkpoint(path)
    try:
        cfg = Config(**ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: model_config does not match leviathan.Config ({e}); "
                        "was it written by another version of leviathan.py?") from None
    try:
        tok = tokenizer_from_meta(ckpt["data_meta"])
    except (KeyError, TypeError) as e:
        raise UserError(f"{path}: data_meta lacks the tokenizer fields ({e}); is it a train.py checkpoint?") from None
    except UserError as e:
        raise UserError(f"{path}: cannot rebuild the data's tokenizer: {e}") from None
    if tok.n_vocab > cfg.vocab_size:
        raise UserError(f"{path}: the tokenizer has {tok.n_vocab} ids but the model only {cfg.vocab_size}")
    with torch.device(device):  # initialise on the device: far faster for a large model on a GPU
        model = Model(cfg)
    check_state_dict(model, ckpt["model"], path)
    model.load_state_dict(ckpt["model"])
    return model.eval(), tok, ckpt.get("step")


def precision(device, bf16=None):
    """The context the model runs in: bf16 autocast on a GPU (the backbone's and the head's matmuls
    in bf16, LEV and the softmax in float32), float32 on a CPU; bf16=True or False overrides that.
    train.py trains in it, so sampling and evaluation run in the training precision."""
    on = torch.device(device).type == "cuda" if bf16 is None else bf16
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if on else nullcontext()


def check_device(name):
    """Refuse a --device this machine cannot use, in one line."""
    try:
        torch.empty(1, device=name)
    except Exception as e:  # RuntimeError, or AssertionError from a torch built without CUDA
        reason = str(e).splitlines()[0]
        reason = reason if len(reason) <= 120 else "this torch was not built for it"  # not its list of backends
        raise UserError(f"device {name!r} is not usable here ({reason}); try --device=cpu") from None


# ---------------------------------------------------------------------------- streaming text


class TextStream:
    """Incremental decoding. A token may end in the middle of a UTF-8 character (o200k
    has many single-byte tokens), which decodes to U+FFFD until the rest arrives. So text
    is printed up to any trailing U+FFFD and the rest is held back; valid UTF-8 never
    changes once complete, so what was printed stays right. `pending` restarts whenever
    the text decodes cleanly, so each step decodes only a few tokens."""

    def __init__(self, tokenizer):
        self.tokenizer, self.pending, self.printed = tokenizer, [], 0

    def push(self, token_id):
        self.pending.append(token_id)
        text = self.tokenizer.decode(self.pending)
        clean = len(text.rstrip("\ufffd"))
        out, self.printed = text[self.printed:clean], clean
        if clean == len(text):  # nothing held back: start afresh
            self.pending, self.printed = [], 0
        return out

    def flush(self):
        """At the end: whatever is left, U+FFFD included (an incomplete character)."""
        out = self.tokenizer.decode(self.pending)[self.printed:]
        self.pending, self.printed = [], 0
        return out


# ---------------------------------------------------------------------------- command line


def parse_args(argv):
    parser = ArgumentParser("sample.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", required=True, help="run folder holding ckpt.pt")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--prompt_file", help="read the prompt from this UTF-8 file (one final newline is dropped)")
    parser.add_argument("--num_samples", type=parse_number(int), default=1, help="samples from the same prompt")
    parser.add_argument("--max_new_tokens", type=parse_number(int), default=256, help="tokens per sample at most")
    parser.add_argument("--temperature", type=parse_number(float), default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=parse_number(int), default=200, help="0 = off")
    parser.add_argument("--top_p", type=parse_number(float), default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    parser.add_argument("--seed", type=parse_number(int), default=1337, help="seed of the sampling generator")
    parser.add_argument("--stop_at_eot", type=parse_bool, nargs="?", const=True, default=True,
                        help="stop a sample at end-of-text (default true)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--compile", type=parse_bool, nargs="?", const=True, default=False,
                        help="torch.compile LEV (before freezing it) and the forward pass")
    parser.add_argument("--bf16", type=parse_bool, nargs="?", const=True, default=None,
                        help="bf16 autocast, as in training (default: on for CUDA, off for CPU)")
    args = parser.parse_args(argv)
    if not 0 <= args.temperature < math.inf:
        raise UserError(f"--temperature must be >= 0 and finite (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be in [0, 2^63), as train.py's, got {args.seed}")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.top_k < 0:
        raise UserError(f"--top_k must be >= 0 (0 = off), got {args.top_k}")
    if args.num_samples < 1 or args.max_new_tokens < 1:
        raise UserError("--num_samples and --max_new_tokens must be at least 1")
    if args.prompt and args.prompt_file:
        raise UserError("pass --prompt or --prompt_file, not both")
    check_device(args.device)
    return args


def read_prompt(args):
    if not args.prompt_file:
        return args.prompt
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --prompt_file {args.prompt_file}: {e}")
    if not text.strip():
        raise UserError(f"--prompt_file {args.prompt_file} is empty; write the prompt into it, "
                        "or pass --prompt= to start from end-of-text")
    return text[:-1] if text.endswith("\n") else text  # editors add a final newline


def sample(args):
    prompt = read_prompt(args)
    model, tok, step = load_model(args.out_dir, args.device)
    # An empty prompt starts at a document boundary: in the training stream every
    # document follows an end-of-text, so the model has learnt what comes after one.
    ids = tok.encode(prompt) if prompt else [tok.eot]
    if len(ids) > model.cfg.seq_len:
        raise UserError(f"the prompt is {len(ids)} tokens but the model's context is "
                        f"{model.cfg.seq_len}; shorten it")
    if args.compile:
        model.compile(dynamic=True)  # before freezing: the compiled generator freezes in half the time on CPU
    model.freeze_lev()  # LEV depends only on the id: evaluate it once, then look it up
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    print(f"# {args.out_dir}: {model.cfg.embedding} arm, step {step}, tokenizer {tok.name} "
          f"({tok.n_vocab} ids), {args.device}", file=sys.stderr)  # stderr: stdout is only text
    for i in range(args.num_samples):
        sys.stdout.write("---------------\n" if i else "")
        start = time.perf_counter()
        with precision(args.device, args.bf16):
            n = print_sample(model, tok, prompt, ids, args, generator)
        print(f"# sample {i + 1}: {n} tokens, {n / (time.perf_counter() - start):.1f} tokens/s", file=sys.stderr)


def print_sample(model, tok, prompt, ids, args, generator):
    """Prompt, then the continuation as it is generated; returns the number of new tokens."""
    stream, n, stop_id = TextStream(tok), 0, tok.eot if args.stop_at_eot else None
    sys.stdout.write(prompt)
    for n, token in enumerate(generate(model, ids, args.max_new_tokens, args.temperature, args.top_k,
                                       args.top_p, generator, stop_id=stop_id, n_valid=tok.n_vocab), 1):
        print(stream.push(token), end="", flush=True)
    print(stream.flush(), flush=True)
    return n


def main(argv=None):
    return run_main(lambda argv: sample(parse_args(argv)), argv)


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a console that cannot show some character
    sys.exit(main())
