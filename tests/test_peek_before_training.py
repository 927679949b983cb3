"""``next(iter(loader))`` before training (to get shapes) loses no sample: batches drawn before
the first optimizer step are drawn again by the next iterator, as with torch's
DistributedSampler, whose every ``__iter__`` starts the epoch over. Real workers, gloo."""

import pytest
from multiworker import ok, run_workers

DATASET_SIZE = 103
SIZES = [4, 8, 8]  # a global batch of 20: one lost peek used to leave 83 of 103 samples trained


@pytest.mark.timeout(150)
@pytest.mark.parametrize("peeking_ranks, loader_workers", [
    ([0, 1, 2], 0),  # every worker peeks
    ([0], 0),  # only rank 0 peeks (e.g. to log shapes)
    ([0, 1, 2], 1),  # a prefetching loader drew more than the peeked batch
])
def test_every_sample_is_trained_once_per_epoch_after_a_peek(peeking_ranks, loader_workers):
    epochs = 2
    results = ok(run_workers(len(SIZES), "peek_cases:train_after_peeking", DATASET_SIZE, SIZES, peeking_ranks,
                              loader_workers, epochs, timeout=140))
    for epoch in range(epochs):
        trained = sorted(i for by_epoch in results for i in by_epoch[epoch])
        assert trained == list(range(DATASET_SIZE)), (
            f"epoch {epoch}: {len(set(trained))} of {DATASET_SIZE} samples trained, {len(trained)} draws")
