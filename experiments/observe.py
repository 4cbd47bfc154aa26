"""A script run as `python SCRIPT` runs it, with what torch did in it written to a JSON file: what
the acceptance run checks of a train.py run that train.py itself does not report.

    python -m experiments.observe OBSERVED.json train.py [train.py's options]
    torchrun --nproc_per_node=2 -m experiments.observe OBSERVED.json train.py [...]  # rank 0 writes

Observers are installed in torch before the script starts (the script is not changed):
- after every optimizer step, TorchDynamo's counters: graphs compiled so far, graph breaks met;
- the gradient communication hook given to DDP (register_comm_hook), by its name, checked apart: each
  bucket is also all-reduced in float32, the hook's mean is held to that one, and DDP is handed the float32
  mean, so that the run trains as DDP's plain all-reduce would (its losses comparable to one process's at
  float32's rounding) while the hook's own error is measured on the run's real gradients.
OBSERVED.json is rewritten whole after each of them (a run killed part-way leaves what it did):
    {"comm_hook": "bf16_compress_hook", or "none" while none is registered,
     "hook_error": the largest |hook's mean - float32 mean| / max |float32 mean| over the buckets, or None,
     "steps": [{"graphs": ..., "graph_breaks": ...}, ...]}   # after this process's step 1, 2, ...
"""
import math
import os
import runpy
import sys
import threading
if not __package__:  # run as a path (python experiments/x.py): the repository is out of reach
    sys.exit("error: run it from the repository's root as: python -m experiments.observe")

import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

from prepare_data import write_json


def observe(path):
    """Install the observers; each writes to path what has been observed so far (rank 0 alone)."""
    observed = dict(comm_hook="none", hook_error=None, steps=[])
    writes = os.environ.get("RANK", "0") == "0"  # torchrun's rank; every rank sees the same
    lock = threading.Lock()  # a bucket's comparison runs on the thread that ends its all-reduce

    def save():
        if writes:
            with lock:  # one write at a time: two would rename the same temporary file
                write_json(path, observed)

    def after_step(optimizer, args, kwargs):
        observed["steps"].append(dict(graphs=counters["stats"]["unique_graphs"],
                                      graph_breaks=sum(counters["graph_break"].values())))
        save()

    register_comm_hook = DistributedDataParallel.register_comm_hook

    def checked(hook):
        """hook, run beside a float32 all-reduce of the same bucket; DDP gets the float32 mean."""
        def run_both(state, bucket):
            exact = bucket.buffer().clone()  # before the hook overwrites the bucket with its own mean
            dist.all_reduce(exact)  # every rank calls it, in the same order as the hook's
            exact /= dist.get_world_size()

            def compare(future):
                error = ((future.value() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()
                worst = observed["hook_error"]  # NaN, once met, stays: max would pass over it
                if worst is None or math.isnan(error) or error > worst:
                    observed["hook_error"] = error
                save()
                return exact
            return hook(state, bucket).then(compare)
        return run_both

    def register_observed(ddp, state, hook):
        register_comm_hook(ddp, state, checked(hook))  # DDP's checks first: a hook it refuses is not in use
        observed["comm_hook"] = hook.__name__
        save()

    register_optimizer_step_post_hook(after_step)
    DistributedDataParallel.register_comm_hook = register_observed
    save()


def main(argv):
    if len(argv) < 2:
        sys.exit("usage: python -m experiments.observe OBSERVED.json SCRIPT [ARGS]")
    path, script, *args = argv
    observe(path)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # `python SCRIPT` puts it first
    runpy.run_path(script, run_name="__main__")  # its sys.exit is this process's


if __name__ == "__main__":
    main(sys.argv[1:])
