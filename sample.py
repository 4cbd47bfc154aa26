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
import argparse, os, sys, time

import torch

from leviathan import Config, Model
from prepare_data import print_error, tokenizer_from_meta


class SampleError(ValueError):
    """Bad input or settings; the command line reports it as one `error:` line."""


# ---------------------------------------------------------------------------- sampling


def sample_next(logits, temperature=1.0, top_k=0, top_p=1.0, generator=None, n_valid=None):
    """One token id from last-position logits [V]. temperature 0 = greedy; top_k 0 and
    top_p 1 switch those filters off. Ids >= n_valid are padding rows of the head that the
    tokenizer cannot decode: a trained model gives them low scores, but not -inf."""
    logits = logits.float().clone()
    if n_valid is not None:
        logits[n_valid:] = float("-inf")
    if temperature == 0:
        return int(logits.argmax())
    logits /= temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        # Nucleus: keep the most likely ids until their mass reaches top_p; the id that
        # crosses the line is kept, so at least one always survives.
        probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        outside = probs.cumsum(-1) - probs >= top_p
        logits[order[outside]] = float("-inf")
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0,
             generator=None, use_cache=True, stop_id=None, n_valid=None):
    """Iterator over up to max_new_tokens new ids that continue prompt_ids (a list of ints,
    1 to seq_len of them). It ends early when stop_id is sampled (stop_id is not yielded).
    use_cache=False reruns the whole context every step: slow, kept as the reference the
    cache is tested against. Both paths apply the same context policy (in _generate)."""
    if not 1 <= len(prompt_ids) <= model.cfg.seq_len:
        raise ValueError(f"the prompt must be 1 to seq_len={model.cfg.seq_len} tokens, got {len(prompt_ids)}")
    return _generate(model, list(prompt_ids), max_new_tokens, temperature, top_k, top_p,
                     generator, use_cache, stop_id, n_valid)


@torch.no_grad()
def _generate(model, tokens, max_new_tokens, temperature, top_k, top_p, generator, use_cache, stop_id, n_valid):
    device, seq_len = model.head.weight.device, model.cfg.seq_len
    # Context policy: the model sees at most seq_len tokens, tokens[start:]. When one more
    # would not fit, the window jumps to the last seq_len // 2 tokens. Cached keys carry
    # their rotary positions, so a window that slid by one token would need a full
    # re-read at every step (no faster than no cache); jumping by half re-reads seq_len/2
    # tokens once per seq_len/2 new ones, about one extra position per token.
    keep = max(1, seq_len // 2)
    start, cache = 0, None
    for _ in range(max_new_tokens):
        if len(tokens) - start > seq_len:
            start, cache = len(tokens) - keep, None
        if not use_cache:
            new = tokens[start:]
        elif cache is None:  # (re)fill: the whole window at once, from position 0
            cache, new = model.new_cache(1), tokens[start:]
        else:  # the cache holds tokens[start:-1]; feed only the last one
            new = tokens[-1:]
        idx = torch.tensor([new], dtype=torch.long, device=device)
        logits = model(idx, cache=cache if use_cache else None)[0, -1]
        next_id = sample_next(logits, temperature, top_k, top_p, generator, n_valid)
        if next_id == stop_id:
            return
        tokens.append(next_id)
        yield next_id


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


# ---------------------------------------------------------------------------- loading


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
        raise SampleError(f"{path}: the weights do not fit the model its model_config describes "
                          f"({'; '.join(problems)}); was it written by another version of leviathan.py?")


def load_checkpoint(out_dir, device="cpu"):
    """(model in eval mode, the run's tokenizer, checkpoint step); then call ready()."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isdir(out_dir):
        raise SampleError(f"run folder {out_dir} not found; pass --out_dir=RUN, the folder train.py wrote")
    if not os.path.isfile(path):
        raise SampleError(f"no checkpoint {path}; train first (python train.py), or pick another --out_dir")
    try:
        # mmap: only the tensors used are read (not the optimizer state train.py saves too)
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a truncated file, not a checkpoint, or pickled objects
        raise SampleError(f"could not read {path} ({type(e).__name__}: {e}); is it a train.py checkpoint?")
    if not (isinstance(ckpt, dict) and {"model", "model_config", "data_meta"} <= ckpt.keys()
            and isinstance(ckpt["model"], dict)):
        raise SampleError(f"{path} lacks model / model_config / data_meta; is it a train.py checkpoint?")
    try:
        cfg = Config(**ckpt["model_config"])
    except (TypeError, ValueError) as e:
        raise SampleError(f"{path}: model_config does not match leviathan.Config ({e}); "
                          "was it written by another version of leviathan.py?")
    tok = load_tokenizer(ckpt["data_meta"], cfg, path)
    with torch.device(device):  # initialise on the device: far faster for a large model on GPU
        model = Model(cfg)
    check_state_dict(model, ckpt["model"], path)
    model.load_state_dict(ckpt["model"])
    return model.eval(), tok, ckpt.get("step")


def ready(model, compile=False):
    """Inference set-up, after every check has passed (freezing o200k takes ~60 s on CPU)."""
    if compile and model.cfg.embedding == "lev":  # halves that time on CPU
        model.lev.compile_generator()
    model.freeze_lev()  # LEV depends only on the id: evaluate it once, then look it up
    if compile:
        model.forward = torch.compile(model.forward, dynamic=True)
    return model


def load_tokenizer(meta, cfg, path):
    try:
        tok = tokenizer_from_meta(meta)
    except (KeyError, TypeError) as e:
        raise SampleError(f"{path}: data_meta lacks the tokenizer fields ({e}); is it a train.py checkpoint?")
    except ValueError as e:  # prepare_data's own errors are ValueErrors
        raise SampleError(f"{path}: cannot rebuild the data's tokenizer: {e}")
    if tok.n_vocab > cfg.vocab_size:
        raise SampleError(f"{path}: the tokenizer has {tok.n_vocab} ids but the model only {cfg.vocab_size}")
    return tok


# ---------------------------------------------------------------------------- command line


def flag(text):
    """--name=true or --name=false (also 1/0, yes/no, on/off); a bare --name is true."""
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


def parse_args(argv):
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one `error:` line instead of usage text
            raise SampleError(f"{message} (see python sample.py --help)")
    p = Parser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out_dir", required=True, help="run folder holding ckpt.pt")
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--prompt_file", help="read the prompt from this UTF-8 file (one final newline is dropped)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="0 = off")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--stop_at_eot", type=flag, nargs="?", const=True, default=True,
                   help="stop a sample at end-of-text (default true)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", type=flag, nargs="?", const=True, default=False,
                   help="torch.compile LEV (before freezing it) and the forward pass")
    args = p.parse_args(argv)
    if not args.temperature >= 0:
        raise SampleError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise SampleError(f"--top_p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.top_k < 0:
        raise SampleError(f"--top_k must be >= 0 (0 = off), got {args.top_k}")
    if args.num_samples < 1 or args.max_new_tokens < 1:
        raise SampleError("--num_samples and --max_new_tokens must be at least 1")
    if args.prompt and args.prompt_file:
        raise SampleError("pass --prompt or --prompt_file, not both")
    try:
        torch.empty(1, device=args.device)
    except Exception as e:  # RuntimeError, or AssertionError from a torch built without CUDA
        raise SampleError(f"device {args.device!r} is not usable here ({str(e).splitlines()[0]}); try --device=cpu")
    return args


def read_prompt(args):
    if not args.prompt_file:
        return args.prompt
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SampleError(f"cannot read --prompt_file {args.prompt_file}: {e}")
    if not text.strip():
        raise SampleError(f"--prompt_file {args.prompt_file} is empty; write the prompt into it, "
                          "or pass --prompt= to start from end-of-text")
    return text[:-1] if text.endswith("\n") else text  # editors add a final newline


def sample(args):
    prompt = read_prompt(args)
    model, tok, step = load_checkpoint(args.out_dir, args.device)
    # An empty prompt starts at a document boundary: in the training stream every
    # document follows an end-of-text, so the model has learnt what comes after one.
    ids = tok.encode(prompt) if prompt else [tok.eot]
    if len(ids) > model.cfg.seq_len:
        raise SampleError(f"the prompt is {len(ids)} tokens but the model's context is "
                          f"{model.cfg.seq_len}; shorten it")
    ready(model, args.compile)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    print(f"# {args.out_dir}: {model.cfg.embedding} arm, step {step}, tokenizer {tok.name} "
          f"({tok.n_vocab} ids), {args.device}", file=sys.stderr)  # stderr: stdout is only text
    for i in range(args.num_samples):
        sys.stdout.write("---------------\n" if i else "")
        t0 = time.perf_counter()
        n = print_sample(model, tok, prompt, ids, args, generator)
        print(f"# sample {i + 1}: {n} tokens, {n / (time.perf_counter() - t0):.1f} tokens/s", file=sys.stderr)


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
    try:
        sample(parse_args(argv))
    except SampleError as e:
        print_error(e)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a console that cannot show some character
    sys.exit(main())
