"""The offline metric index of curriculum learning, as DeepSpeed 0.19.8's DataAnalyzer
writes it for a `single_value_per_sample` metric
(deepspeed/runtime/data_pipeline/data_sampling/data_analyzer.py), so DeepSpeed's sampler
and shardwise's read the same files.

For a metric NAME over N samples, under OUT/NAME/ (MMIDIDX files, runtime/data/indexed_dataset.py):

    NAME_sample_to_metric              one row per sample: its value
    NAME_index_to_metric               one row per distinct value, ascending: the value
    NAME_index_to_sample               the same rows: the samples with that value, in dataset order
    NAME_index_to_sample_percentile_merged
                                       index_to_sample's rows joined max(1, rows // 100) at a time

(the first three with DeepSpeed's document index of a merged file, [0, rows, rows]).

Values are stored in the narrowest integer dtype holding them, sample indices in the
narrowest holding N - 1 (DeepSpeed's find_fit_int_dtype). The config's
`index_to_sample_path` / `index_to_metric_path` name OUT/NAME/NAME_index_to_sample and
OUT/NAME/NAME_index_to_metric.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardwise.runtime.data.indexed_dataset import smallest_int_dtype, write_rows


def write_metric_index(values: np.ndarray, out: str | Path, name: str) -> Path:
    """The four files of DeepSpeed's DataAnalyzer for integer `values` (one per sample),
    under out/name/; returns that folder."""
    values = np.asarray(values)
    if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer) or len(values) == 0:
        raise ValueError(f"a metric index needs one integer value per sample; got {values.dtype} of shape "
                         f"{values.shape}")
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    value_dtype = smallest_int_dtype(int(values.min()), int(values.max()))
    sample_dtype = smallest_int_dtype(0, len(values) - 1)
    prefix = str(folder / name)
    write_rows(f"{prefix}_sample_to_metric", [np.array([value]) for value in values], value_dtype,
               merged=True)
    distinct = np.unique(values)
    by_value = [np.flatnonzero(values == value) for value in distinct]
    write_rows(f"{prefix}_index_to_sample", by_value, sample_dtype, merged=True)
    write_rows(f"{prefix}_index_to_metric", [np.array([value]) for value in distinct], value_dtype, merged=True)
    step = max(1, len(by_value) // 100)
    merged = [np.concatenate(by_value[start: start + step]) for start in range(0, len(by_value), step)]
    write_rows(f"{prefix}_index_to_sample_percentile_merged", merged, sample_dtype)
    return folder
