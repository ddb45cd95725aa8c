"""`deepspeed.utils.RepeatingLoader` (also `deepspeed.runtime.dataloader.RepeatingLoader`, as in
DeepSpeed): a loader iterated forever, which pipeline scripts wrap theirs in."""


class RepeatingLoader:
    """Iterate `loader` forever, restarting it at its end (a pipeline's `train_batch` pulls
    micro-batches and must never meet the end of an epoch mid-batch). Over the engine's
    loader, a restored data position applies to the pass it is in."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
