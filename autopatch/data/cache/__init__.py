"""Bagua's sample cache: ``CacheLoader`` (values kept in a store by key) and ``CachedDataset``
(samples kept after their first load), with hit and miss counts shared across loader workers."""
