"""The research tools, each run as `python -m experiments.TOOL` from the repository root."""
import sys

if sys.argv[0] == "-m":  # python -m experiments.TOOL, the tool not yet loaded: Ctrl-C during its imports is one line
    from prepare_data import quiet_interrupt
    quiet_interrupt()
