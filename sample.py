"""Sample text from a trained Leviathan run.

    python sample.py --out_dir=RUN                       # a new document, from end-of-text
    python sample.py --out_dir=RUN --prompt="The river" --num_samples=3 --temperature=0.8 --top_p=0.95
    python sample.py --out_dir=RUN --prompt_file=prompt.txt --temperature=0 --no-stop_at_eot
"""
import argparse, codecs, math, os, signal, sys, textwrap, time

from prepare_data import UserError, run_main, tokenizer_from_meta
if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C while torch loads ends the process, no traceback
import torch

from leviathan import Config, Model, generate_text, precision
from train import load_checkpoint

def load_model(out_dir, device="cpu"):
    """A run's model in eval mode, the tokenizer of its data, and its step. For inference, call
    model.freeze_lev() once every other check has passed (slow for a large vocabulary on a CPU)."""
    path, other = os.path.join(out_dir, "ckpt.pt"), "was it written by another version of leviathan.py?"
    ckpt = load_checkpoint(path, ("model", "model_config", "data_meta"))
    try:  # Config checks model_config; tokenizer_from_meta rebuilds the tokenizer data_meta names
        cfg, tok = Config(**ckpt["model_config"]), tokenizer_from_meta(ckpt["data_meta"])
    except (TypeError, ValueError, KeyError, UserError) as e:
        raise UserError(f"{path}: its model_config or data_meta does not fit this code "
                        f"({type(e).__name__}: {e}); {other}") from None
    with torch.device(device):  # initialised on the device: far faster for a large model on a GPU
        model = Model(cfg)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # its message: a header line, then each missing, unexpected or reshaped tensor
        mismatch = textwrap.shorten(str(e).split("\n", 1)[-1].rstrip(". "), 200, placeholder=" ...")
        raise UserError(f"{path}: the weights do not fit its model_config ({mismatch}); {other}") from None
    # A run that diverged: greedy decoding would print the argmax of nan logits, id 0, as if it were text.
    if bad := [k for k, v in ckpt["model"].items() if v.is_floating_point() and not v.isfinite().all()]:
        raise UserError(f"{path}: {', '.join(bad[:3])} hold nan or inf (a run that diverged); "
                        "use an earlier checkpoint")
    return model.eval(), tok, ckpt.get("step")

def check_device(name):  # a --device this machine cannot use is one line
    try:
        torch.empty(1, device=name)
    except Exception as e:  # RuntimeError, or AssertionError from a torch built without CUDA
        reason = next((r for r in str(e).splitlines()[:1] if len(r) <= 120),
                      "this torch was not built for it")
        raise UserError(f"device {name!r} is not usable here ({reason}); try --device=cpu") from None

class TextStream:
    """Token-by-token decoding: the bytes of a UTF-8 character split over tokens wait until it is whole."""
    def __init__(self, tokenizer):
        self.token_bytes = tokenizer.decode_single_token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    def push(self, token_id):
        return self.utf8.decode(self.token_bytes(token_id))
    def flush(self):  # an incomplete last character as U+FFFD
        return self.utf8.decode(b"", final=True)

def utf8_text(path):
    """--prompt_file's text. A file that is not there is run_main's one line; one that is not UTF-8,
    argparse's (a UnicodeDecodeError is a ValueError)."""
    with open(path, encoding="utf-8") as f:
        return f.read().removesuffix("\n")  # editors add one

def parse_args(argv):
    parser = argparse.ArgumentParser(prog="sample.py", usage="%(prog)s --out_dir=RUN [--name=value]",
                                     allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out_dir", required=True, help="run folder holding ckpt.pt")
    prompt = parser.add_mutually_exclusive_group()  # both: argparse refuses in one line
    prompt.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    prompt.add_argument("--prompt_file", dest="prompt", type=utf8_text,
                        help="read the prompt from this UTF-8 file (one final newline is dropped)")
    add("--num_samples", type=int, default=1, help="samples from the same prompt")
    add("--max_new_tokens", type=int, default=256, help="tokens per sample at most")
    add("--temperature", type=float, default=0.8, help="0 = greedy")
    add("--top_k", type=int, default=200, help="0 = off")
    add("--top_p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 = off")
    add("--seed", type=int, default=1337, help="seed of the sampling generator")
    flag = argparse.BooleanOptionalAction  # --name, or --no-name
    add("--stop_at_eot", action=flag, default=True, help="end a sample at end-of-text")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    add("--compile", action="store_true", help="torch.compile LEV (before freezing) and the forward pass")
    add("--bf16", action=flag, help="bf16 autocast, as in training (None: on CUDA)")
    args = parser.parse_args(argv)
    # Out of range: the least likely ids (temperature < 0), a torch traceback (top_k, top_p, seed), no output
    for name, fits, allowed in [("temperature", 0 <= args.temperature < math.inf, ">= 0 and finite"),
                                ("top_k", args.top_k >= 0, ">= 0 (0 = off)"),
                                ("top_p", 0 < args.top_p <= 1, "in (0, 1] (1 = off)"),
                                ("seed", 0 <= args.seed < 2**63, "in [0, 2^63), as train.py's"),
                                ("num_samples", args.num_samples >= 1, "at least 1"),
                                ("max_new_tokens", args.max_new_tokens >= 1, "at least 1")]:
        if not fits:
            raise UserError(f"--{name} must be {allowed}, got {getattr(args, name)}")
    check_device(args.device)
    return args

def sample(args):
    model, tok, step = load_model(args.out_dir, args.device)
    # Empty, the prompt is a document boundary: in training every document follows an end-of-text.
    ids = tok.encode_ordinary(args.prompt) if args.prompt else [tok.eot_token]
    if len(ids) > model.cfg.seq_len:
        raise UserError(f"the prompt is {len(ids)} tokens but the model's context is {model.cfg.seq_len}; "
                        "shorten it")
    if args.compile:
        model.compile(dynamic=True)  # before freezing: the compiled generator freezes in half the time on CPU
    model.freeze_lev()  # LEV depends only on the id: evaluate it once, then look it up
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    print(f"# {args.out_dir}: {model.cfg.embedding} arm, step {step}, tokenizer {tok.name} "
          f"({tok.n_vocab} ids), {args.device}", file=sys.stderr)  # stderr: stdout is only text
    for i in range(args.num_samples):
        sys.stdout.write(("---------------\n" if i else "") + args.prompt)
        stream, n, start = TextStream(tok), 0, time.perf_counter()
        with precision(args.device, args.bf16):
            for n, token in enumerate(generate_text(model, ids, args.max_new_tokens, args.temperature,
                                                    args.top_k, args.top_p, generator, n_valid=tok.n_vocab,
                                                    stop_id=tok.eot_token if args.stop_at_eot else None), 1):
                print(stream.push(token), end="", flush=True)
        print(stream.flush(), flush=True)
        speed = n / (time.perf_counter() - start)
        print(f"# sample {i + 1}: {n} tokens, {speed:.1f} tokens/s", file=sys.stderr)

def main(argv=None):
    return run_main(lambda argv: sample(parse_args(argv)), argv)

if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a console that cannot show some character
    sys.exit(main())
