"""Sample text from a trained Leviathan run.

    python sample.py --out_dir=RUN                       # a new document, from end-of-text
    python sample.py --out_dir=RUN --prompt="The river" --num_samples=3 --top_p=0.95
    python sample.py --out_dir=RUN --prompt_file=prompt.txt --temperature=0 --no-stop_at_eot

The samples' text goes to stdout; what was loaded and how fast it ran, to stderr.
"""
import argparse
import codecs
import os
import sys
import time

import torch

from leviathan import Config, Model, generate_text, precision
from prepare_data import UserError, check_checkpoint, tokenizer_from_meta

def load_model(out_dir, device="cpu"):
    """A run's model in eval mode, the tokenizer of its data, and its step, from out_dir/ckpt.pt.
    For inference, call model.freeze_lev() next (slow for a large vocabulary on a CPU)."""
    path = os.path.join(out_dir, "ckpt.pt")
    check_checkpoint(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    # A run that diverged: greedy decoding would take the argmax of nan logits, id 0, and print it
    # as if it were text.
    broken = [name for name, tensor in checkpoint["model"].items()
              if tensor.is_floating_point() and not tensor.isfinite().all()]
    if broken:
        raise UserError(f"{path}: {', '.join(broken[:3])} hold nan or inf (the run diverged); "
                        "sample an earlier checkpoint")
    config = Config(**checkpoint["model_config"])
    tokenizer = tokenizer_from_meta(checkpoint["data_meta"])
    with torch.device(device):  # built where it will run: far faster for a large model on a GPU
        model = Model(config)
    model.load_state_dict(checkpoint["model"])
    return model.eval(), tokenizer, checkpoint["step"]

class TextStream:
    """Decodes one token at a time. A UTF-8 character can be split over tokens: its first bytes
    wait until the rest arrive, so that a half character is never printed."""

    def __init__(self, tokenizer):
        self.token_bytes = tokenizer.decode_single_token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id):
        return self.utf8.decode(self.token_bytes(token_id))

    def flush(self):  # a character still incomplete at the end comes out as U+FFFD
        return self.utf8.decode(b"", final=True)

def utf8_text(path):
    """The text of --prompt_file. A file that is not UTF-8 raises a ValueError, which argparse
    reports as an invalid value of the option."""
    with open(path, encoding="utf-8") as file:
        return file.read().removesuffix("\n")  # the newline an editor adds at the end of a file

def parse_args(argv):
    parser = argparse.ArgumentParser(prog="sample.py", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --out_dir=RUN [--name=value ...]",
                                     allow_abbrev=False)  # a misspelt option: refused, not guessed
    add = parser.add_argument
    add("--out_dir", required=True, help="the train.py run folder whose ckpt.pt is sampled")
    prompt = parser.add_mutually_exclusive_group()  # both given: argparse refuses them
    prompt.add_argument("--prompt", default="",
                        help="the text to continue; empty (the default) starts a new document")
    prompt.add_argument("--prompt_file", dest="prompt", type=utf8_text, metavar="PATH",
                        help="read the prompt from this UTF-8 file (one final newline is dropped)")
    add("--num_samples", type=int, default=1, help="how many samples to draw from the same prompt")
    add("--max_new_tokens", type=int, default=256, help="the most tokens each sample adds")
    add("--temperature", type=float, default=0.8,
        help="divides the logits: below 1 favours the likely ids, above 1 the rest; 0 = greedy")
    add("--top_k", type=int, default=200, help="draw among the k likeliest ids only; 0 = all")
    add("--top_p", type=float, default=1.0,
        help="draw among the fewest likeliest ids that hold this probability, in (0, 1]; 1 = all")
    add("--seed", type=int, default=1337, help="the draws' seed: the same seed, the same text")
    add("--stop_at_eot", action=argparse.BooleanOptionalAction, default=True,
        help="end a sample where the model ends its document (end-of-text)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the model runs: cpu, cuda, cuda:1, ... (default: cuda if there is one)")
    add("--compile", action="store_true",
        help="torch.compile the model: a slower start, then faster tokens")
    add("--bf16", action=argparse.BooleanOptionalAction,
        help="bf16 autocast, as in training (default: on CUDA only); --no-bf16 runs in float32")
    args = parser.parse_args(argv)
    # Two values that would sample from another distribution than the one asked for, with no sign:
    if args.temperature < 0:  # dividing the logits by it makes the least likely ids the likeliest
        raise UserError(f"--temperature={args.temperature} is negative: give 0 (greedy) or more")
    # At 0 or less top_p would draw greedily (where top_k's 0 means off), above 1 from all ids.
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p={args.top_p} is not in (0, 1]: give a probability, 1 for all ids")
    return args

def sample(args):
    # First: a --device or a --seed this torch cannot take fails here, before the model loads.
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    model, tokenizer, step = load_model(args.out_dir, args.device)
    # An empty prompt starts a new document: in training, every document follows an end-of-text.
    prompt_ids = tokenizer.encode_ordinary(args.prompt) if args.prompt else [tokenizer.eot_token]
    stop_id = tokenizer.eot_token if args.stop_at_eot else None
    if args.compile:
        model.compile(dynamic=True)  # before freezing: compiled, LEV freezes twice as fast on a CPU
    model.freeze_lev()  # LEV's output depends only on the id: computed once each, then looked up
    # On stderr: stdout holds only the samples' text.
    print(f"# {args.out_dir}: {model.cfg.embedding} arm, step {step}, tokenizer {tokenizer.name} "
          f"({tokenizer.n_vocab} ids), {args.device}", file=sys.stderr)
    for number in range(1, args.num_samples + 1):
        # Called before the prompt is printed: it refuses a prompt longer than the model's context.
        # Ids past n_valid are the head's padding rows, which the tokenizer cannot decode.
        new_ids = generate_text(model, prompt_ids, args.max_new_tokens, args.temperature,
                                args.top_k, args.top_p, generator, stop_id=stop_id,
                                n_valid=tokenizer.n_vocab)
        if number > 1:
            print("---------------")
        print(args.prompt, end="")
        stream = TextStream(tokenizer)
        count = 0
        start = time.perf_counter()
        with precision(args.device, args.bf16):
            for token_id in new_ids:
                print(stream.push(token_id), end="", flush=True)  # as soon as it is drawn
                count += 1
        print(stream.flush(), flush=True)
        speed = count / (time.perf_counter() - start)
        print(f"# sample {number}: {count} tokens, {speed:.1f} tokens/s", file=sys.stderr)

def main(argv=None):
    """The command line, as an exit status: 0, or 1 after one line `error: <what went wrong>`."""
    try:
        sample(parse_args(argv))
    except BrokenPipeError:
        # The reader has gone (`python sample.py ... | head -1`): end quietly, as a Unix tool does.
        # stdout now goes to /dev/null, so that Python's last flush at exit has no pipe to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError) as error:  # a missing file, a refused option or checkpoint, ...
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.stdout.reconfigure(errors="replace")  # a console that cannot show a character shows "?"
    sys.exit(main())
