"""The research tools, each run as `python -m experiments.TOOL` from the repository root."""
import sys

import signal

if sys.argv[0] == "-m" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # python -m experiments.TOOL, the tool not yet loaded: Ctrl-C during its imports (seconds of torch) ends
    # the process as at a shell's prompt, no traceback; cli.run_main then makes it
    # KeyboardInterrupt again
    signal.signal(signal.SIGINT, signal.SIG_DFL)
