"""Export a trained run as a Hugging Face transformers folder: LlamaForCausalLM, no custom code.

    python -m experiments.export --out_dir=out/tiny-lev --hf_dir=out/tiny-lev-hf

The folder holds config.json, generation_config.json, model.safetensors (float32) and, when it
encodes exactly as the run's tokenizer does, a fast tokenizer (tokenizer.json); then
    transformers.AutoModelForCausalLM.from_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(folder)
load it. transformers is optional: pip install "transformers>=5,<6" (5.25 tested).

The backbone is LLaMA's, weight for weight: qkv and gate_up are split into q/k/v_proj and
gate_proj/up_proj, RMSNorm eps 1e-6, rotate-half rotary with the run's base, no biases. The
input side becomes an ordinary table: LEV frozen (Model.freeze_lev, LEV for every id) on the lev
arm, the table itself on the others; the tied arm ties lm_head to it. config.json's "leviathan"
entry records the arm, the step, the checkpoint's size and time, the whole model config (LEV's
hyper-parameters and its (R) sigmoid scale included) and the tokenizer. What transformers cannot
hold: LEV itself (only its table for these ids), and generation past seq_len (sample.py slides its
window; transformers extrapolates the rotary positions). Padding ids of the head are suppressed in
generation_config.

Before it finishes, the export loads the folder with transformers and checks that its logits are
those of our Model on one window (max |difference| <= 1e-4 x max(1, max |logit|)); and the
tokenizer, that it gives our ids on sample texts. Otherwise: an error line (the model) or a line
saying the tokenizer was left out.
"""
import argparse, dataclasses, gc, json, os, shutil, struct, sys, time
if not __package__:  # run as a path (python experiments/x.py): the repository's modules are out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.export")

import torch

from experiments.cli import run_main
from leviathan import Config
from prepare_data import UserError, hold_folder
from sample import load_model

INSTALL = 'pip install "transformers>=5,<6"'
MARK = "leviathan"  # config.json's entry of our metadata
# Every Config field and where it goes: a field this table lacks (a later leviathan.py) may change
# what the model computes, so the export refuses it rather than guess.
MAPPED = {"vocab_size", "d_model", "n_layer", "n_head", "seq_len", "embedding", "rope_theta"}
LEV_ONLY = {"lev_digits", "lev_seed_dim", "lev_heads", "lev_knots", "lev_rank", "lev_sigmoid_scale"}  # frozen
TOLERANCE = 1e-4
SAMPLE_TEXTS = [  # the tokenizer's check: words, numbers, spaces, newlines, contractions, other scripts
    "Hello world! It's 2024, isn't it?  Numbers: 12345 678.9\n\n\tdef f(x):\n        return x ** 2\n",
    "naïve café, Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어, العربية 🙂🚀",
    "   leading spaces, trailing spaces   \r\n\r\nCRLF and <|endoftext|> as plain text, I'M YOU'LL we'd",
]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m experiments.export", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --out_dir=RUN --hf_dir=DIR [--name=value]", allow_abbrev=False)
    parser.add_argument("--out_dir", required=True, help="run folder holding ckpt.pt")
    parser.add_argument("--hf_dir", required=True, help="folder to write (made if absent; an earlier export "
                        "there is replaced, any other content refused)")
    parser.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True,
                        help="also export the tokenizer when it is exact")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- the weights


def llama_weights(model):
    """Our state, under LlamaForCausalLM's names: {name: float32 tensor}, views where possible.
    The tied arm's lm_head is left out: transformers ties it to embed_tokens on loading."""
    cfg = model.cfg
    table = model.frozen_table if cfg.embedding == "lev" else model.embed.weight
    weights = {"model.embed_tokens.weight": table}
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.chunk(3, dim=0)  # rows: q, k, v
        gate, up = block.mlp.gate_up.weight.chunk(2, dim=0)  # rows: gate, up
        weights.update({
            prefix + "input_layernorm.weight": block.attn_norm.weight,
            prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": block.attn.proj.weight,
            prefix + "post_attention_layernorm.weight": block.mlp_norm.weight,
            prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": block.mlp.down.weight})
    weights["model.norm.weight"] = model.norm.weight
    if cfg.embedding != "tied":
        weights["lm_head.weight"] = model.head.weight
    return {name: w.detach().float().contiguous() for name, w in weights.items()}


def write_safetensors(path, tensors):
    """The safetensors format (an 8-byte header length, a JSON header, the raw little-endian data),
    written tensor by tensor: no second copy of the model in memory, as safetensors.torch.save_file
    makes (~5 GB at 1.2b)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(memoryview(t.numpy()).cast("B"))  # little-endian on every machine torch runs on


def llama_config(transformers, cfg, tok, source):
    if unknown := sorted({f.name for f in dataclasses.fields(Config)} - MAPPED - LEV_ONLY):
        raise UserError(f"model_config field(s) {', '.join(unknown)} have no LlamaForCausalLM equivalent "
                        "known to this export (a newer leviathan.py?); not exported")
    record = dict(embedding=cfg.embedding, **source, model_config=dataclasses.asdict(cfg), n_valid=tok.n_vocab,
                  tokenizer=tok.name,  # o200k_base_first8192: o200k_base cut to 8,192 ids
                  input_side={"lev": "LEV frozen into a [V, D] table (Model.freeze_lev)",
                              "tied": "the tied table (lm_head tied to it)",
                              "untied": "the untied input table"}[cfg.embedding])
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
        head_dim=cfg.d_model // cfg.n_head, hidden_act="silu", max_position_embeddings=cfg.seq_len,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=cfg.embedding == "tied",
        bos_token_id=tok.eot_token, eos_token_id=tok.eot_token, pad_token_id=None,
        architectures=["LlamaForCausalLM"], dtype="float32", **{MARK: record})


# ---------------------------------------------------------------------------- the tokenizer


def fast_tokenizer(transformers, tok, seq_len):
    """tiktoken's byte-level BPE as a `tokenizers` BPE: the vocabulary is its ranks (bytes as
    GPT-2's printable characters), the merges every split a + b of a token into two tokens,
    ordered by the rank of a + b (tiktoken merges the adjacent pair whose concatenation ranks
    lowest, leftmost first); ignore_merges, as tiktoken, takes a piece that is a token whole;
    the pre-tokenizer is its pat_str. End-of-text is a special token that text never produces
    (split_special_tokens): our encode treats a literal "<|endoftext|>" as plain text."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    ranks, byte_char = tok._mergeable_ranks, bytes_to_unicode()
    def chars(b):
        return "".join(byte_char[x] for x in b)
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    merges.sort(key=lambda m: m[:3])
    eot = tok.decode_single_token_bytes(tok.eot_token).decode()
    vocab = {chars(t): r for t, r in ranks.items()} | {eot: tok.eot_token}  # o200k: a gap of one id before it
    fast = Tokenizer(models.BPE(vocab, [(chars(a), chars(b)) for *_, a, b in merges], ignore_merges=True))
    fast.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok._pat_str), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    fast.decoder = decoders.ByteLevel()
    fast.add_special_tokens([AddedToken(eot, special=True, normalized=False)])
    if fast.token_to_id(eot) != tok.eot_token:
        raise ValueError(f"end-of-text got id {fast.token_to_id(eot)}, not {tok.eot_token}")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=fast, bos_token=eot, eos_token=eot,
                                                split_special_tokens=True, model_max_length=seq_len)


def export_tokenizer(transformers, tok, hf_dir, seq_len):
    """Writes the tokenizer if it is exact on SAMPLE_TEXTS once reloaded; else says why in one line."""
    try:
        fast_tokenizer(transformers, tok, seq_len).save_pretrained(hf_dir)
        loaded = transformers.AutoTokenizer.from_pretrained(hf_dir)
        # verbose=False: a sample text longer than seq_len is no error here (transformers would warn)
        wrong = [t for t in SAMPLE_TEXTS
                 if loaded(t, add_special_tokens=False, verbose=False)["input_ids"] != tok.encode_ordinary(t)]
        if wrong:
            raise ValueError(f"it encodes {wrong[0][:30]!r}... otherwise")
    except Exception as e:  # an unsupported regex, a tokenizers version that reads the files otherwise
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(path := os.path.join(hf_dir, name)):
                os.remove(path)
        reason = " ".join(str(e).split())[:160]
        print(f"tokenizer not exported: not exact ({type(e).__name__}: {reason}); the model alone is")
        return False
    return True


# ---------------------------------------------------------------------------- the command


MANIFEST = "leviathan_export.json"  # written last: each file the export wrote, with its size and mtime


def written_files(folder):
    """{name: [size, mtime]} of the files in folder but the manifest and the lock."""
    stats = {name: os.stat(os.path.join(folder, name)) for name in os.listdir(folder)}
    return {name: [s.st_size, s.st_mtime_ns] for name, s in stats.items() if name not in (MANIFEST, ".lock")}


def check_folder(given):
    """An absent or empty folder, or an earlier export of this tool whose files are still those it wrote (the
    manifest's names, sizes and times): anything else there is someone's work, refused rather than replaced.
    Returns the folder to swap the export in for: given's real path (through a symlink, where it points)."""
    if not given:
        raise UserError("--hf_dir is empty: name the folder to write")
    hf_dir = os.path.realpath(given)
    if os.path.ismount(hf_dir):  # else found at the swap, the last step: a mount point is not renamed
        raise UserError(f"--hf_dir={given} is a mount point, which cannot be swapped for the export: "
                        "give a folder inside it")
    if os.path.isfile(hf_dir):
        raise UserError(f"--hf_dir={given} is a file; give a folder")
    if not os.path.isdir(hf_dir) or not os.listdir(hf_dir):
        return hf_dir
    try:
        with open(os.path.join(hf_dir, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        raise UserError(f"--hf_dir={given} holds files that are not an export of this tool (no {MANIFEST}); "
                        "choose an empty or new folder") from None
    found = written_files(hf_dir)
    changed = sorted(name for name in found.keys() | manifest.keys() if found.get(name) != manifest.get(name))
    if changed:
        raise UserError(f"--hf_dir={given} holds files this tool did not write, or changed since "
                        f"({changed[0]}): move them aside, or choose an empty or new folder")
    return hf_dir


def export(args):
    try:
        import transformers
    except ImportError:
        raise UserError(f"experiments.export needs transformers: {INSTALL}") from None
    transformers.utils.logging.disable_progress_bar()  # the loading check's bar: noise in a one-line report
    hf_dir = check_folder(args.hf_dir)
    start = time.perf_counter()
    ckpt = os.stat(os.path.join(args.out_dir, "ckpt.pt"))  # before it is read: never a newer one's stat
    model, tok, step = load_model(args.out_dir)
    source = dict(step=step, checkpoint=[ckpt.st_size, ckpt.st_mtime_ns])  # what experiments.evaluate compares
    # Written beside the target, then swapped in whole: a failed or cut export leaves the earlier one as it was
    partial = f"{hf_dir}.partial"
    if os.path.isdir(partial) and os.listdir(partial) and not os.path.exists(os.path.join(partial, ".lock")):
        raise UserError(f"{partial} holds files this tool did not write: move it aside to export to {args.hf_dir}")
    os.makedirs(partial, exist_ok=True)
    with hold_folder(partial, "--hf_dir"):  # one export at a time to a folder
        for name in os.listdir(partial):  # an export cut short: ours, by its name and lock
            if name != ".lock":
                os.remove(os.path.join(partial, name))
        cfg = model.cfg
        window, expected = write_model(transformers, model, tok, source, partial)
        del model  # before transformers loads its copy: one model in memory at a time
        gc.collect()
        with_tokenizer, difference = check_export(transformers, tok, cfg.seq_len, partial, window, expected,
                                                  args.tokenizer)
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump(written_files(partial), f)
        os.remove(os.path.join(partial, ".lock"))
        if os.path.isdir(hf_dir):  # the earlier export, checked above: replaced whole
            shutil.rmtree(f"{partial}.old", ignore_errors=True)
            os.rename(hf_dir, f"{partial}.old")
        os.rename(partial, hf_dir)
        shutil.rmtree(f"{partial}.old", ignore_errors=True)
    print(f"{args.hf_dir}: LlamaForCausalLM from {args.out_dir} ({cfg.embedding} arm, step {step}), "
          f"{'with' if with_tokenizer else 'without'} tokenizer; logits within {difference:.2g} of the model's; "
          f"{time.perf_counter() - start:.1f} s")


def write_model(transformers, model, tok, source, hf_dir):
    """The weights, config.json and generation_config.json into hf_dir; returns a window of real ids (end-of-text,
    then the sample text, as our model sees a document) and our logits on it, for the check."""
    model.freeze_lev()
    cfg = model.cfg
    window = torch.tensor([([tok.eot_token] + tok.encode_ordinary(" ".join(SAMPLE_TEXTS)))[:min(cfg.seq_len, 64)]])
    with torch.no_grad():
        expected = model(window)
    write_safetensors(os.path.join(hf_dir, "model.safetensors"), llama_weights(model))
    llama_config(transformers, cfg, tok, source).save_pretrained(hf_dir)
    padding = list(range(tok.n_vocab, cfg.vocab_size))  # never sampled (sample.py's n_valid)
    eot = tok.eot_token
    transformers.GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                                  **({"suppress_tokens": padding} if padding else {})).save_pretrained(hf_dir)
    return window, expected


def check_export(transformers, tok, seq_len, hf_dir, window, expected, with_tokenizer):
    """The tokenizer written if exact; transformers' logits held to ours. Returns (with tokenizer, difference)."""
    with_tokenizer = with_tokenizer and export_tokenizer(transformers, tok, hf_dir, seq_len)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        got = hf(window).logits
    difference, scale = (got - expected).abs().max().item(), max(1.0, expected.abs().max().item())
    if not difference <= TOLERANCE * scale:
        raise UserError(f"transformers' logits differ from the model's by {difference:.3g} (> {TOLERANCE * scale:.3g}): "
                        "not a faithful export, so the earlier one (if any) stays")
    return with_tokenizer, difference


def main(argv=None):
    return run_main(lambda argv: export(parse_args(argv)), argv)


if __name__ == "__main__":
    sys.exit(main())
