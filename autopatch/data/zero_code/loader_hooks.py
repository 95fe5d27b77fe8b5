"""What happens when a DataLoader is built, or iterated, while the data patches are installed.

``DataLoader(dataset, ...)``: a map-style dataset is probed once (``cacheability.py``) and either
served through a ``CachedDataset`` behind a transparent proxy or left as it is, with the reason.
Its cache name is the settings' name (or the class name) and the dataset's signature, so two
datasets of one class keep separate entries and a changed dataset starts afresh. The cache must
pay, one decision for the whole job (``cache_payoff.py``). A DistributedSampler (the class itself;
a subclass may order on purpose) is replaced by a ``FollowingSampler`` at the loader's batch
size, every dataset scored once and the scores agreed across ranks (``agreed_scores.py``); a
complexity named by a string is only called when ``complexity.py`` allows it.

``iter(loader)``: the files the dataset names are stat'ed again (``dataset_files``), and a few
samples, different each epoch (``signature.recheck_indices``), are loaded again as the loader
loads them and compared with their entries; a dataset whose files, samples or length changed is
served uncached from then on, and its entries are dropped (workers forked for the epoch see it;
``persistent_workers`` keep what they were started with).

Nothing here raises into the user's program (``FUSEDOPT_STRICT=1`` aside): a failure leaves the
DataLoader as the user built it, and is reported.
"""

import inspect
import time
import warnings
import weakref

from torch.utils.data import DistributedSampler

from ... import env
from ..cache.cache_loader import CacheLoader
from ..cache.cached_dataset import CachedDataset
from ..cache.shared_counters import COUNTS
from ..looking.load_settings import loader_threads
from ..probe.cache_payoff import cache_pays
from ..probe.cacheability import probe
from ..probe.signature import encoded_samples, recheck_indices
from ..sampling.agreed_scores import NoAgreement, agreed_scores
from ..sampling.balanced_sampler import score_samples
from ..sampling.complexity import UntrustedComplexity, complexity_function
from ..sampling.following_sampler import FollowingSampler
from ..sampling.step_balance import distributed_sampler_indices, spread_summary, step_spreads
from ..store.backends import backend_name
from .transparent_dataset import TransparentCachedDataset, bypass

__all__ = ["LoaderHooks"]


class _PerObject:
    """Values kept per object by identity (datasets need not be hashable), forgotten when an
    object that allows weak references is collected."""

    def __init__(self):
        self._items = {}

    def get(self, obj):
        item = self._items.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else None

    def put(self, obj, value):
        try:
            ref = weakref.ref(obj, lambda _, key=id(obj): self._items.pop(key, None))
        except TypeError:
            ref = lambda obj=obj: obj   # noqa: E731 (no weak reference possible: kept alive)
        self._items[id(obj)] = (ref, value)


class _DatasetFate:
    """What became of one dataset: how to serve it through the cache, or why it is left alone.

    It holds neither the dataset nor its proxy (a DataLoader holds the proxy, the proxy the
    dataset), so a dataset the program drops is freed; its counters stay for the report."""

    def __init__(self, label, reason="", recipe=None, verdict=None, length=0, checker=None):
        self.label, self.reason, self.recipe, self.verdict, self.length = label, reason, recipe, verdict, length
        self.checker = checker   # the CacheLoader that measured the store, and rechecks entries
        self.loaders = [checker] if checker is not None else []   # every CacheLoader, for the counts
        self.rechecks = 0
        self.bypassed = None     # why the cache was turned off for it during the run
        self._proxy = None       # weak reference to the live proxy

    def proxy(self, dataset):
        live = self.live_proxy()
        if live is None:
            cached = CachedDataset(dataset, **self.recipe)
            live = TransparentCachedDataset(dataset, cached, self.bypassed)
            self._proxy = weakref.ref(live)
            self.loaders.append(cached.cache_loader)
        return live

    def live_proxy(self):
        return self._proxy() if self._proxy is not None else None

    def bypass(self, reason):
        if self.bypassed is None:
            self.bypassed = reason
            if self.live_proxy() is not None:
                bypass(self.live_proxy(), reason)


class LoaderHooks:
    def __init__(self, settings):
        self.settings = settings
        self._datasets = _PerObject()   # the user's dataset -> _DatasetFate
        self._fates = []                # every _DatasetFate, for the report
        self._samplers = _PerObject()   # the user's sampler -> weak reference to its FollowingSampler
        self._replacements = []         # (weak reference to a FollowingSampler, scoring seconds, note)
        self._scores = _PerObject()     # dataset -> (complexities, seconds spent scoring, note)
        self._left_alone = []           # samplers not replaced, and why
        self._failures = []
        self._warned = set()
        self.loaders = 0                # DataLoaders built while installed

    # -- DataLoader(...) --------------------------------------------------------------------
    def on_init(self, wrapped, instance, args, kwargs):
        self.loaders += 1
        try:
            bound = inspect.signature(wrapped).bind(*args, **kwargs)
        except TypeError:
            return wrapped(*args, **kwargs)   # DataLoader reports the bad call itself
        arguments = bound.arguments
        try:
            if self.settings.backend is not None and "dataset" in arguments:
                arguments["dataset"] = self._serve(arguments["dataset"])
            if self.settings.balance is not None and arguments.get("sampler") is not None:
                arguments["sampler"] = self._balanced(arguments["sampler"], arguments["dataset"],
                                                      arguments.get("batch_size", 1))
        except Exception as e:
            self._failures.append(f"{type(e).__name__}: {e}")
            if env.flag(env.STRICT):
                raise
            warnings.warn(f"autopatch: DataLoader left as built, the data patches failed: {e}",
                          RuntimeWarning, stacklevel=3)
            return wrapped(*args, **kwargs)
        return wrapped(*bound.args, **bound.kwargs)

    def _serve(self, dataset):
        if isinstance(dataset, TransparentCachedDataset):
            return dataset
        fate = self._datasets.get(dataset)
        if fate is None:
            fate = self._decide(dataset)
            self._datasets.put(dataset, fate)
            self._fates.append(fate)
        return fate.proxy(dataset) if fate.recipe is not None else dataset

    def _decide(self, dataset):
        cls = type(dataset)
        label = f"{cls.__module__}.{cls.__qualname__}"
        if isinstance(dataset, CachedDataset):
            return _DatasetFate(label, "already a CachedDataset")
        verdict = probe(dataset)
        if not verdict.cacheable:
            return _DatasetFate(label, verdict.reason)
        recipe = dict(backend=self.settings.backend, signature=verdict.signature, **self._store_options(),
                      dataset_name=f"{self.settings.name or cls.__qualname__}-{verdict.signature.hex()[:16]}")
        checker = CacheLoader(**{k: v for k, v in recipe.items() if k != "signature"}, stamp=verdict.signature)
        if checker.unavailable:
            checker.close()
            return _DatasetFate(label, f"the cache is unavailable: {checker.unavailable}")
        pays, why = cache_pays(checker, verdict)
        if not pays:
            checker.close()
            return _DatasetFate(label, why)
        return _DatasetFate(label, why, recipe=recipe, verdict=verdict, length=len(dataset), checker=checker)

    def _store_options(self):
        s = self.settings
        if s.backend == "local":
            return {k: v for k, v in (("path", s.path), ("capacity", s.capacity)) if v}
        if s.backend == "redis":
            return {"capacity_per_node": s.capacity} if s.capacity else {}
        return {}

    # -- iter(loader) -----------------------------------------------------------------------
    def on_iter(self, wrapped, instance, args, kwargs):
        dataset = instance.dataset
        fate = self._datasets.get(dataset.__wrapped__) if isinstance(dataset, TransparentCachedDataset) else None
        if fate is not None and fate.recipe is not None and fate.bypassed is None:
            try:
                self._recheck(fate, dataset.__wrapped__, loader_threads(instance.num_workers))
            except Exception as e:
                fate.bypass(f"re-checking samples failed: {type(e).__name__}: {e}")
        return wrapped(*args, **kwargs)

    @staticmethod
    def _recheck(fate, dataset, threads):
        """Stat the files the dataset names, load this epoch's recheck samples as the loader would
        and compare them with their entries; a difference drops the dataset's entries and serves
        it uncached."""
        if len(dataset) != fate.length:
            fate.checker.forget()
            fate.bypass("the dataset's length changed during the run; served uncached from then on")
            return
        changed_file = fate.verdict.files.changed()
        if changed_file:
            fate.checker.forget()
            fate.bypass(f"{changed_file} since the dataset was cached; its entries were dropped and it is "
                        "served uncached from then on")
            return
        indices = recheck_indices(fate.length, fate.verdict.signature, fate.rechecks)
        fate.rechecks += 1
        for loader in fate.loaders:   # writes of this process still waiting are served as well
            loader.flush()
        fresh = encoded_samples(dataset, indices, threads=threads)
        stored = fate.checker.peek_encoded(indices, threads)
        changed = [i for i, s in zip(indices, stored) if s is not None and s != fresh[i]]
        if changed:
            fate.checker.forget()
            fate.bypass(f"sample {changed[0]} changed since it was cached; the dataset's entries were dropped "
                        "and it is served uncached from then on")

    # -- samplers ---------------------------------------------------------------------------
    def _balanced(self, sampler, dataset, batch_size):
        known = self._samplers.get(sampler)
        if known is not None and known() is not None:
            return known()
        if not isinstance(sampler, DistributedSampler):
            return sampler
        label = f"{type(sampler).__module__}.{type(sampler).__qualname__}"
        if type(sampler) is not DistributedSampler:
            return self._leave(sampler, label, "a subclass of DistributedSampler may order samples on purpose")
        if len(sampler.dataset) != len(dataset):
            return self._leave(sampler, label, "its dataset is not the loader's")
        try:
            complexity_fn = complexity_function(self.settings.balance)
        except UntrustedComplexity as e:
            return self._refuse(sampler, label, str(e))
        scores = self._scores.get(dataset)
        if scores is None:
            start = time.perf_counter()
            mine = score_samples(dataset, complexity_fn)
            try:
                agreed, note = agreed_scores(dataset, mine)
            except NoAgreement as e:
                return self._refuse(sampler, label, str(e))
            scores = (agreed, time.perf_counter() - start, note)
            self._scores.put(dataset, scores)
        replaced = FollowingSampler(sampler, dataset, scores[0], batch_size=batch_size)
        self._samplers.put(sampler, weakref.ref(replaced))
        self._replacements.append((weakref.ref(replaced), scores[1], scores[2]))
        return replaced

    def _refuse(self, sampler, label, reason):
        """Leave the user's sampler, and say why once on stderr (FUSEDOPT_STRICT=1: raise)."""
        if env.flag(env.STRICT):
            raise RuntimeError(f"the DistributedSampler cannot be balanced: {reason}")
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"autopatch: the DistributedSampler is kept, not balanced: {reason}", RuntimeWarning,
                          stacklevel=4)
        return self._leave(sampler, label, reason)

    def _leave(self, sampler, label, reason):
        if {"sampler": label, "reason": reason} not in self._left_alone:
            self._left_alone.append({"sampler": label, "reason": reason})
        return sampler

    # -- uninstall --------------------------------------------------------------------------
    def hand_back(self):
        """Loaders built while installed get their own dataset and sampler back; the cache's
        counters and connections are let go."""
        for fate in self._fates:
            if fate.recipe is not None:
                fate.bypass("autopatch was disabled")
            for loader in fate.loaders:
                loader.close()
        for ref, _, _ in self._replacements:
            if ref() is not None:
                ref().bypass()

    # -- report -----------------------------------------------------------------------------
    def describe(self):
        out = {"cache": self._describe_cache(), "balance": self._describe_balance()}
        if self._failures:
            out["failures"] = list(self._failures)
        return out

    def _describe_cache(self):
        if self.settings.backend is None:
            return {"enabled": False}
        total = dict.fromkeys(COUNTS, 0)
        cached, uncached = [], []
        for fate in self._fates:
            if fate.recipe is None:
                uncached.append({"dataset": fate.label, "reason": fate.reason})
                continue
            item = {"dataset": fate.label, "backend": backend_name(self.settings.backend),
                    "name": fate.recipe["dataset_name"], "decided": fate.reason, **dict.fromkeys(COUNTS, 0)}
            for loader in fate.loaders:
                figures = loader.describe()
                for k in COUNTS:
                    item[k] += figures[k]
                    total[k] += figures[k]
                for k in ("last_error", "repaired"):
                    if figures.get(k):
                        item[k] = figures[k]
            if item["errors"]:
                item["degraded"] = (f"{item['errors']} store errors or rejected entries; each sample concerned was "
                                    "loaded from the dataset instead, so training is unchanged")
            if fate.bypassed:
                item["bypassed"] = fate.bypassed
            cached.append(item)
        return {"enabled": True, "backend": backend_name(self.settings.backend), **total,
                "datasets": cached, "uncached": uncached}

    def _describe_balance(self):
        if self.settings.balance is None:
            return {"enabled": False}
        samplers = []
        for ref, scoring_seconds, note in self._replacements:
            s = ref()
            if s is None:
                continue
            batch = s.batch_size or 1
            ours = step_spreads(s.rank_indices(), s.complexities, batch)
            theirs = step_spreads(distributed_sampler_indices(s.dataset, s.num_replicas, s.seed, s.epoch,
                                                              s.shuffle, s.drop_last), s.complexities, batch)
            samplers.append({"ranks": s.num_replicas, "rank": s.rank, "batch_size": s.batch_size,
                             "epoch": s.epoch, "samples_scored": len(s.complexities),
                             "scoring_seconds": round(scoring_seconds, 3), "scores": note,
                             "complexity_max_over_mean": {"balanced": spread_summary(ours),
                                                          "distributed_sampler": spread_summary(theirs)}})
        balance = self.settings.balance
        return {"enabled": True, "samplers": samplers, "left_alone": list(self._left_alone),
                "complexity": balance if isinstance(balance, str) else getattr(balance, "__qualname__", repr(balance))}
