"""GPT datasets and the micro-batch loader.

``build_gpt_datasets`` builds train/valid/test datasets with megatron-core's
BlendedMegatronDatasetBuilder, GPTDatasetConfig and GPTDataset (MockGPTDataset for
``mock_data``), from Megatron's --data-path ("prefix", or "w1 p1 w2 p2 ..." blends) and --split
("969,30,1"). Called on every rank: without torch.distributed, each process builds its own;
inside a process group megatron-core builds on rank 0 first (writing its index cache), then
``barrier()`` on the default group, then the other ranks load rank 0's cache. Every rank gets the
same datasets (the indices depend only on the seed, the sizes, the data and the tokenizer).

Index caches (document / sample / shuffle ``.npy``, one set per split) go to ``data_cache_path``
or, as in Megatron, to ``{prefix}/cache/GPTDataset_indices/`` when it is None (a directory named
like the prefix, beside its .bin and .idx). MockGPTDataset caches nothing.

``MicroBatchLoader.get(iteration, microbatch)`` is the batch of global micro-batch ``microbatch``
of iteration ``iteration``: sample j is dataset index
``(iteration * num_micro_batches + microbatch) * micro_batch_size + j``, whatever the parallel
layout.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import numpy
import torch

__all__ = ["DataError", "DatasetExhaustedError", "build_gpt_datasets", "parse_data_path",
           "MicroBatchLoader"]


class DataError(ValueError):
    """The data cannot be used as given (one-line message naming the path or the cause)."""


class DatasetExhaustedError(DataError, IndexError):
    """A micro-batch asks for samples past the end of the dataset."""


def parse_data_path(data_path) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's --data-path list -> (prefixes, weights or None).

    Accepts ["prefix"], ["p1", "p2"] (weights from the dataset sizes), ["w1", "p1", "w2", "p2"],
    and the same as one whitespace-separated string.
    """
    if data_path is None:
        raise DataError("no --data-path given (or use --mock-data)")
    if isinstance(data_path, (str, os.PathLike)):
        data_path = [data_path]
    words: List[str] = []
    for item in data_path:
        words.extend(os.fspath(item).split())
    if not words:
        raise DataError("--data-path is empty")

    def number(word: str) -> Optional[float]:
        try:
            return float(word)
        except ValueError:
            return None

    if len(words) % 2 == 0 and all(number(w) is not None for w in words[0::2]):
        weights = [number(w) for w in words[0::2]]
        prefixes = words[1::2]
        for w, p in zip(weights, prefixes):
            if not w > 0 or w != w or w == float("inf"):
                raise DataError(f"--data-path weight {w} for {p} must be a positive number")
    else:
        weights, prefixes = None, words
    return prefixes, weights


def _check_prefix(prefix: str) -> None:
    for ext in (".bin", ".idx"):
        path = prefix + ext
        if not os.path.isfile(path):
            raise DataError(f"data path {prefix}: {path} not found (a --data-path prefix needs "
                            f"{os.path.basename(prefix)}.bin and .idx; make them with "
                            f"tools/preprocess_data.py)")
        if not os.access(path, os.R_OK):
            raise DataError(f"data path {prefix}: {path} is not readable")


def _empty_splits(prefix: str, split_matrix, sizes, config) -> List[int]:
    """The splits of ``prefix`` that hold no tokens; DataError where one is asked for samples.

    megatron-core's GPTDataset loops forever on a split without tokens (even for 0 samples).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    try:
        dataset = IndexedDataset(prefix, mmap=True)
        # A copy: the arrays are views of an mmap that IndexedDataset.__del__ closes (a later
        # read of a view then segfaults).
        lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64, copy=True)
        del dataset
    except Exception as e:  # megatron-core asserts on a bad header
        raise DataError(f"data path {prefix}: not a readable IndexedDataset "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    n = lengths.shape[0]
    empty = []
    for split in Split:
        bounds = split_matrix[split.value]
        if bounds is None:
            continue
        beg = int(round(bounds[0] * float(n)))
        end = int(round(bounds[1] * float(n)))
        if int(lengths[beg:end].sum()) > 0:
            continue
        need = sizes[split.value]
        if need:
            raise DataError(
                f"data path {prefix}: the {split.name} split ({end - beg} of {n} documents with "
                f"--split {config.split}) has no tokens, but {need} {split.name} samples are asked "
                f"for; give it more documents or a split weight of 0")
        empty.append(split.value)
    return empty


class _NoCachePathNoise(logging.Filter):
    """Drops megatron-core's per-split warning that it cannot save indices without a cache path
    (always so for MockGPTDataset, which needs none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "because path_to_cache is None" not in record.getMessage()


_NOISE_FILTER = _NoCachePathNoise()


def _quiet_megatron_core_loggers() -> None:
    for name in ("megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_dataset"):
        log = logging.getLogger(name)
        if _NOISE_FILTER not in log.filters:
            log.addFilter(_NOISE_FILTER)


def _blended_dataset_class():
    """megatron-core's BlendedDataset, fixed for a cache directory without torch.distributed.

    BlendedDataset._build_indices calls torch.distributed.get_rank() on a cache miss whenever a
    cache path is set, which raises in a single process. This subclass builds without the cache
    path in that case, then writes the cache files megatron-core would have written.
    """
    from megatron.core.datasets.blended_dataset import BlendedDataset

    class _BlendedDataset(BlendedDataset):
        def _build_indices(self):
            cache = self.config.path_to_cache
            if (torch.distributed.is_initialized() or not cache or self.config.defer_npy_index_mmap
                    or self.config.fast_cache_load):
                return super()._build_indices()
            base = os.path.join(
                cache, f"{self.unique_description_hash}-BlendedDataset-{self.split.name}-")
            paths = [base + s for s in ("description.txt", "dataset_index.npy",
                                        "dataset_sample_index.npy")]
            if all(map(os.path.isfile, paths)):
                return super()._build_indices()  # a cache hit never asks for the rank
            config = self.config
            self.config = copy.copy(config)
            self.config.path_to_cache = None
            try:
                dataset_index, dataset_sample_index = super()._build_indices()
            finally:
                self.config = config
            os.makedirs(cache, exist_ok=True)
            with open(paths[0], "wt") as writer:
                writer.write(self.unique_description)
            numpy.save(paths[1], dataset_index, allow_pickle=True)
            numpy.save(paths[2], dataset_sample_index, allow_pickle=True)
            return dataset_index, dataset_sample_index

    _BlendedDataset.__name__ = _BlendedDataset.__qualname__ = "BlendedDataset"  # same cache names
    return BlendedDataset, _BlendedDataset


def _builder_class():
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    blended, fixed = _blended_dataset_class()

    class _Builder(BlendedMegatronDatasetBuilder):
        @staticmethod
        def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
            if cls is blended:
                cls = fixed
            return BlendedMegatronDatasetBuilder.build_generic_dataset(
                cls, is_built_on_rank, synchronize_ranks, *args)

    return _Builder


def build_gpt_datasets(*, data_path: Optional[Sequence[str]], mock_data: bool, split: str,
                       seq_length: int, seed: int, tokenizer, train_samples: int,
                       valid_samples: int, test_samples: int,
                       data_cache_path: Optional[str] = None, eod_mask_loss: bool = False,
                       reset_position_ids: bool = False, reset_attention_mask: bool = False,
                       mmap_bin_files: bool = True, builder_threads: int = 1):
    """(train, valid, test) GPT datasets; None for a split of weight 0, or one asked for 0
    samples that holds no documents.

    Raises DataError for a missing or unreadable data path, a bad blend or split, or a split
    that is asked for samples but has no tokens. Must be called on all ranks of the default
    process group when one is initialised (megatron-core barriers on it).
    """
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if seq_length is None or int(seq_length) < 1:
        raise DataError(f"--seq-length must be positive, got {seq_length}")
    sizes = [int(train_samples), int(valid_samples), int(test_samples)]
    if any(s < 0 for s in sizes):
        raise DataError(f"sample counts must be non-negative, got {sizes}")
    if tokenizer is None:
        raise DataError("build_gpt_datasets needs a tokenizer")

    if mock_data:
        blend = None
        cls = MockGPTDataset
    else:
        prefixes, weights = parse_data_path(data_path)
        for prefix in prefixes:
            _check_prefix(prefix)
        blend = (prefixes, weights)
        cls = GPTDataset
    if split is None:
        split = "969,30,1"
    split = str(split)
    if not mock_data:
        try:
            split_weights = [float(w) for w in re.split(r"[,/\s]+", split.strip()) if w]
        except ValueError:
            split_weights = []
        if not (1 <= len(split_weights) <= 3 and all(w >= 0 for w in split_weights)
                and sum(split_weights) > 0):
            raise DataError(f"--split {split!r} must be 1 to 3 non-negative weights with a "
                            f"positive sum, like 969,30,1")

    config = GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=blend,
        split=split,
        path_to_cache=os.fspath(data_cache_path) if data_cache_path else None,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        # the causal mask is implied unless documents must not attend to each other
        create_attention_mask=reset_attention_mask,
        mmap_bin_files=mmap_bin_files, num_dataset_builder_threads=builder_threads,
    )
    if not mock_data:
        for prefix in blend[0]:
            for i in _empty_splits(prefix, config.split_matrix, sizes, config):
                config.split_matrix[i] = None  # asked for 0 samples and has none: no dataset
    _quiet_megatron_core_loggers()
    builder = _builder_class()(cls, sizes, lambda: True, config)
    try:
        train, valid, test = builder.build()
    except IndexError as e:  # a weighted blend over-samples a small dataset
        raise DataError(f"cannot blend --data-path {' '.join(map(str, data_path or []))}: "
                        f"{str(e).splitlines()[0]}") from None
    return train, valid, test


class MicroBatchLoader:
    """Micro-batches by (iteration, global micro-batch id), independent of the parallel layout.

    ``get(i, g)`` stacks dataset samples ``(i * num_micro_batches + g) * micro_batch_size + j``
    for j in range(micro_batch_size) (megatron-core GPTDataset ``__getitem__`` dicts; with
    ``cyclic``, that index k is the dataset's sample ``perm_e[k mod n]``, a permutation seeded by
    (seed, epoch e = k // n), so training cycles through ever-reshuffled passes) into
    tokens [b, s] int64, labels [b, s] int64, loss_mask [b, s] float32, position_ids [b, s]
    int64, and attention_mask [b, 1, s, s] bool only if the dataset makes one. Non-tensor fields
    (a BlendedDataset's dataset_id) are dropped.
    """

    def __init__(self, dataset, micro_batch_size: int, num_micro_batches: int, *,
                 num_workers: int = 0, cyclic_seed: Optional[int] = None,
                 first_samples: Optional[List[int]] = None) -> None:
        """`num_workers` >= 2: threads that read one micro-batch's samples at once
        (--num-workers); `cyclic_seed`: --dataloader-type cyclic with this seed;
        `first_samples`: the samples consumed before each iteration when the batch grows
        (--rampup-batch-size; else iteration x samples per iteration)."""
        if dataset is None:
            raise DataError("MicroBatchLoader got no dataset (is its --split weight 0?)")
        if int(micro_batch_size) < 1 or int(num_micro_batches) < 1:
            raise DataError(f"micro_batch_size and num_micro_batches must be positive, got "
                            f"{micro_batch_size} and {num_micro_batches}")
        self.dataset = dataset
        self.micro_batch_size = int(micro_batch_size)
        self.num_micro_batches = int(num_micro_batches)
        self.cyclic_seed = cyclic_seed
        self.first_samples = first_samples
        self._epoch: Tuple[int, Optional[torch.Tensor]] = (-1, None)
        self._pool = ThreadPoolExecutor(num_workers) if num_workers >= 2 else None

    def _sample(self, k: int):
        if self.cyclic_seed is None:
            return self.dataset[k]
        n = len(self.dataset)
        epoch, position = divmod(k, n)
        if self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.cyclic_seed + epoch)
            self._epoch = (epoch, torch.randperm(n, generator=gen))
        return self.dataset[int(self._epoch[1][position])]

    @property
    def samples_per_iteration(self) -> int:
        return self.micro_batch_size * self.num_micro_batches

    @property
    def num_iterations(self) -> int:
        """Whole iterations the dataset holds."""
        return len(self.dataset) // self.samples_per_iteration

    def sample_indices(self, iteration: int, microbatch: int) -> range:
        """The dataset indices of one global micro-batch."""
        iteration, microbatch = int(iteration), int(microbatch)
        if iteration < 0:
            raise DataError(f"iteration must be >= 0, got {iteration}")
        if not 0 <= microbatch < self.num_micro_batches:
            raise DataError(f"micro-batch {microbatch} is outside [0, {self.num_micro_batches})")
        first = self.first_samples[iteration] if self.first_samples is not None \
            else iteration * self.samples_per_iteration
        start = first + microbatch * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def get(self, iteration: int, microbatch: int) -> Dict[str, torch.Tensor]:
        indices = self.sample_indices(iteration, microbatch)
        n = len(self.dataset)
        if indices.stop > n and self.cyclic_seed is None:
            raise DatasetExhaustedError(
                f"iteration {iteration} micro-batch {microbatch} needs dataset samples "
                f"{indices.start}..{indices.stop - 1}, but the dataset has {n} "
                f"({n // self.samples_per_iteration} iterations of {self.samples_per_iteration}); "
                f"build it with more samples")
        samples = list(self._pool.map(self._sample, indices) if self._pool
                       else map(self._sample, indices))
        batch = {}
        for key, value in samples[0].items():
            if isinstance(value, torch.Tensor):
                batch[key] = torch.stack([s[key] for s in samples])
            elif isinstance(value, numpy.ndarray):
                batch[key] = torch.stack([torch.from_numpy(numpy.asarray(s[key])) for s in samples])
        for key in ("tokens", "labels", "position_ids"):
            if key in batch:
                batch[key] = batch[key].long()
        if "loss_mask" in batch:
            batch["loss_mask"] = batch["loss_mask"].float()
        return batch

    def __repr__(self) -> str:
        return (f"MicroBatchLoader({type(self.dataset).__name__} of {len(self.dataset)}, "
                f"micro_batch_size={self.micro_batch_size}, "
                f"num_micro_batches={self.num_micro_batches})")
