"""Worker for tests/test_hosts.py: joins the job and prints ``rank R starts at B``, the starting
batch size that ``add_batch_arguments``' ``--batch-size`` (default ``$DYNAMIX_BATCH_SIZE``, which
``bpslaunch --batch-size`` sets) gives its rank. Usage: batch_size_worker.py"""

import argparse

import torch

import dynamix_byteps as bps
from dynamix_byteps.assignment import add_batch_arguments, parse_batch_sizes

torch.set_num_threads(1)
parser = argparse.ArgumentParser()
add_batch_arguments(parser)
args = parser.parse_args()
bps.init()
print(f"rank {bps.rank()} starts at {parse_batch_sizes(args.batch_size, bps.size())[bps.rank()]}", flush=True)
bps.shutdown()
