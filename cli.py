"""What every script shares on the command line: bad input reported as one `error:` line with a
non-zero exit status, never a traceback, and the rules every option follows."""
import argparse, sys


class UserError(Exception):
    """Bad input, or a failure the user can fix: reported as one `error:` line, exit status 1."""


def print_error(e):
    """One `error:` line on stderr, however many lines the message holds."""
    print("error: " + " ".join(str(e).split()), file=sys.stderr)


def run_main(command, argv=None):
    """A script's command(argv), its exit status returned: a UserError is reported as one line
    (status 1) and Ctrl-C as one line (130), so no traceback reaches the user."""
    try:
        command(argv)
    except UserError as e:
        print_error(e)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


def parse_bool(text):
    """The true/false rule of every option: --name=true or --name=false (also 1/0, yes/no, on/off)."""
    if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() in ("1", "true", "yes", "on")


def check_device(name):
    """Refuse a --device this machine cannot use, in one line."""
    import torch  # here, not at the top: prepare_data.py never pays for importing torch
    try:
        torch.empty(1, device=name)
    except Exception as e:  # RuntimeError, or AssertionError from a torch built without CUDA
        raise UserError(f"device {name!r} is not usable here ({str(e).splitlines()[0]}); try --device=cpu") from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a mistake raised as a UserError (one line) instead of usage text and exit 2.
    `prog` is the script's name, so the hint is right when main() runs in-process too."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def error(self, message):
        raise UserError(f"{message} (see python {self.prog} --help)")

