"""Store backends by name: ``local`` (the node-local lmdb default), ``redis`` (a server per node,
Bagua's layout), or Redis servers given as ``redis://host:port`` URLs, comma-separated."""

__all__ = ["open_store", "BACKENDS", "backend_name", "is_redis"]

BACKENDS = ("local", "redis")


def _is_url(backend):
    return isinstance(backend, str) and backend.startswith(("redis://", "rediss://", "unix://"))


def is_redis(backend):
    return backend == "redis" or _is_url(backend)


def backend_name(backend):
    """'local', 'redis', or 'redis' for URLs: what the report shows."""
    return "redis" if _is_url(backend) else backend


def open_store(backend="local", **kwargs):
    """The store for ``backend``; ``kwargs`` go to it: ``path`` and ``capacity`` for ``local``;
    ``hosts``, ``cluster_mode`` and ``capacity_per_node`` for ``redis``."""
    if backend == "local":
        from .local_store import LocalStore
        return LocalStore(**kwargs)
    if backend == "redis" or _is_url(backend):
        from .redis_store import RedisStore
        if _is_url(backend):
            kwargs["hosts"] = [u.strip() for u in backend.split(",") if u.strip()]
        return RedisStore(**kwargs)
    raise ValueError(f"unknown cache backend {backend!r}: use one of {BACKENDS} or redis://host:port URLs")
