"""What the tools' command lines share: an error as one line, Ctrl-C as an exit status, and the JSON
files they read back (their own, and a train.py run's) named when one is damaged."""
import json
import os
import signal
import sys
from pathlib import Path

from prepare_data import UserError


def run_main(command, argv):
    """command(argv) as an exit status: a refusal (UserError, any ValueError) or an OSError (a path,
    a full disk) is one `error:` line and 1; Ctrl-C is 130, once what it interrupted has stopped (a
    run that runs.wait watches gets SIGTERM and saves first); `| head` closing stdout is 0."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:  # experiments/__init__.py's, importing
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return command(argv) or 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # Python's last flush must find no pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, ValueError) as error:  # a message of several lines joined into one
        sys.stderr.write("error: " + " ".join(str(error).split()) + "\n")
        return 1


def read_json(path, fix):
    """A JSON file a tool or train.py wrote; damaged (an editor, a disk), a UserError naming it and
    `fix`, what to do about it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both are
        raise UserError(f"{path}: not valid JSON ({str(error).splitlines()[0]}); {fix}") from None
