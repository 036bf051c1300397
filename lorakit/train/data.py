"""Batches from the cache: items of one bucket, text padded with a mask, deterministic order."""

from __future__ import annotations

from lorakit.cache.store import Store
from lorakit.data.buckets import batches
from lorakit.errors import ConfigError
from lorakit.models.batch import Batch, drop_full_mask


class CachedData:
    """The items of a built cache, and the batch order of every epoch (a pure function of seed, epoch)."""

    def __init__(self, store: Store, manifest: dict, batch_size: int, seed: int, repeats: int = 1,
                 hold_out: int = 0, in_memory: bool = False, datasets: list | None = None,
                 prior_ratio: float | None = None):
        """`datasets`: cfg.data.all_datasets() (weight, repeats, role, loss_weight of each, by the manifest's
        dataset index); without it every item is seen `repeats` times per epoch."""
        import random

        self.store = store
        self.memo: dict | None = {} if in_memory else None  # memory.cache_in_memory: each entry read once
        items = list(manifest["items"])
        ds = datasets or []

        def of(it):
            return ds[it.get("dataset", 0)] if ds else None

        trainable = [i for i, it in enumerate(items) if not of(it) or of(it).role == "train"]
        if hold_out and hold_out >= len(trainable):
            raise ConfigError([f"validation.items: {hold_out} would leave no item to train on "
                               f"(the cache has {len(trainable)})"])
        held = set(random.Random(seed).sample(trainable, hold_out)) if hold_out else set()
        self.validation = [it for i, it in enumerate(items) if i in held]  # fixed by the seed
        self.items = [it for i, it in enumerate(items) if i not in held]
        self.empty_key = manifest.get("empty_caption")
        self.batch_size = batch_size
        self.seed = seed
        # visits per epoch of each item: repeats x weight; prior datasets scaled to prior_ratio x the training ones
        self.visits = {it["key"]: (of(it).repeats * of(it).weight if of(it) else repeats) for it in self.items}
        prior = {it["key"] for it in self.items if of(it) and of(it).role == "prior"}
        if prior and prior_ratio:
            train_total = sum(v for k, v in self.visits.items() if k not in prior)
            scale = prior_ratio * train_total / sum(self.visits[k] for k in prior)
            for k in prior:
                self.visits[k] *= scale
        self.loss_weight = {it["key"]: of(it).loss_weight for it in self.items if of(it)}
        self.group = {it["key"]: tuple(it.get("group", it["bucket"])) for it in self.items}  # + control sizes
        # the input shapes a step meets: its bucket (with control sizes); validation batches too
        self.shapes = len(set(self.group.values()) | {tuple(it.get("group", it["bucket"])) for it in self.validation})
        self._epoch_cache: dict[int, list] = {}
        self._empty = None

    def epoch_items(self, e: int) -> dict:
        """The epoch's visits (key#r -> group): whole visits always, a fraction in that share of epochs."""
        import random

        rng = random.Random(self.seed * 7919 + e)
        out = {}
        for key, v in self.visits.items():
            n = int(v)
            if v - n > 1e-9 and rng.random() < v - n:
                n += 1
            for r in range(n):
                out[f"{key}#{r}"] = self.group[key]
        if not out:  # every item a fraction, none drawn: the most weighted one
            key = max(self.visits, key=self.visits.get)
            out[f"{key}#0"] = self.group[key]
        return out

    def epoch(self, e: int) -> list[list[str]]:
        if e not in self._epoch_cache:
            self._epoch_cache = {e: batches(self.epoch_items(e), self.batch_size, self.seed * 1000 + e)}
        return self._epoch_cache[e]

    def batch_at(self, index: int) -> list[str]:
        """The index-th batch of the endless epoch sequence (resume = same index, same batch)."""
        e = 0
        while True:
            ep = self.epoch(e)
            if index < len(ep):
                return [k.split("#")[0] for k in ep[index]]
            index -= len(ep)
            e += 1

    def empty(self) -> dict:
        if self._empty is None and self.empty_key and self.store.has(self.empty_key):
            self._empty = self.store.get(self.empty_key)
        return self._empty

    def entry(self, key: str) -> dict:
        if self.memo is None:
            return self.store.get(key)
        if key not in self.memo:
            self.memo[key] = self.store.get(key)
        return self.memo[key]

    def load(self, keys: list[str], drop: list[bool] | None = None, variants: list[int] | None = None) -> Batch:
        """`variants`: which cached caption ordering each item uses (data.caption_shuffle; 0: as written)."""
        import torch

        entries = [self.entry(k) for k in keys]
        texts = []
        for i, e in enumerate(entries):
            v = variants[i] if variants else 0
            t = {k: e[f"{k}@{v}"] if v else e[k] for k in ("prompt_embeds", "pooled") if k in e}
            if drop and drop[i]:
                if "empty_prompt_embeds" in e:
                    t["prompt_embeds"] = e["empty_prompt_embeds"]
                elif self.empty() is not None:
                    t = dict(self.empty())
            texts.append(t)
        L = max(t["prompt_embeds"].shape[0] for t in texts)
        emb = torch.zeros(len(texts), L, texts[0]["prompt_embeds"].shape[-1], dtype=texts[0]["prompt_embeds"].dtype)
        mask = torch.zeros(len(texts), L, dtype=torch.long)
        for i, t in enumerate(texts):
            n = t["prompt_embeds"].shape[0]
            emb[i, :n] = t["prompt_embeds"]
            mask[i, :n] = 1
        text = {"prompt_embeds": emb, "prompt_embeds_mask": mask}
        if "pooled" in texts[0]:
            text["pooled"] = torch.stack([t["pooled"] for t in texts])
        n_ctrl = sum(1 for k in entries[0] if k.startswith("control_latents_"))
        controls = [torch.stack([e[f"control_latents_{c}"] for e in entries]) for c in range(n_ctrl)]
        masks = [e.get("loss_mask") for e in entries]
        mask = None
        if any(m is not None for m in masks):
            like = next(m for m in masks if m is not None)
            mask = torch.stack([m if m is not None else torch.ones_like(like) for m in masks]).float()
        weights = None
        if any(self.loss_weight.get(k, 1.0) != 1.0 for k in keys):
            weights = torch.tensor([self.loss_weight.get(k, 1.0) for k in keys], dtype=torch.float32)
        return drop_full_mask(Batch(keys, torch.stack([e["latents"] for e in entries]), text, controls, mask,
                                    weights))
