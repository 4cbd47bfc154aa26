"""What every script shares on the command line: bad input reported as one `error:` line with a
non-zero exit status, never a traceback, and the rules every option follows (true/false, numbers
such as 262_144 or 4.2e9, a dataclass's fields as options)."""
import argparse, dataclasses, inspect, re, sys


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


def parse_number(kind):
    """int or float from an option's text; ints also as 262_144 or 4.2e9 (when whole)."""
    def parse(text):
        try:
            number = float(text.replace("_", ""))
            if kind is int and number != int(number):
                raise ValueError
            return kind(number)
        except (ValueError, OverflowError):  # OverflowError: int('inf')
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    return parse


def add_dataclass_options(parser, cls, none_means):
    """One --name=value option per field of the dataclass cls, its help the comment on the field's
    line; a field left out of the command line is left out of the parsed options (SUPPRESS)."""
    helps = dict(re.findall(r"^    (\w+): .*  # (.*)$", inspect.getsource(cls), re.M))
    for field in dataclasses.fields(cls):
        kind = next(t for t in getattr(field.type, "__args__", [field.type]) if t is not type(None))
        default = none_means if field.default is None else field.default
        if default != "" and "None:" not in helps[field.name]:  # those comments say what None means
            helps[field.name] += f" (default: {default})"
        how = dict(type=parse_bool, nargs="?", const=True) if kind is bool else dict(
            type=parse_number(kind) if kind in (int, float) else str)
        parser.add_argument(f"--{field.name}", default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                            help=helps[field.name].replace("%", "%%"), **how)
