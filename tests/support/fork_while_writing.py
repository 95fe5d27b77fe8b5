"""A CachedDataset used in the main process, whose buffer's timer thread writes to the local store
while DataLoader workers are forked, 30 times: ``python fork_while_writing.py STORE``. Prints the
cache's errors and entries; a fork taken in the middle of a timer's write would hang a worker."""

import sys

from torch.utils.data import DataLoader

from autopatch.data import CachedDataset
from data_fixtures import Features

cached = CachedDataset(Features(400, load_seconds=0), backend="local", dataset_name="d", writer_buffer_size=1000,
                       path=sys.argv[1])
cached.cache_loader.writes.max_age = 0.01   # the timer writes all the time
for r in range(30):
    for i in range(r * 10, r * 10 + 10):
        cached[i]
    for _ in DataLoader(cached, batch_size=8, num_workers=2):
        pass
print(cached.describe()["errors"], cached.cache_loader.num_keys())
