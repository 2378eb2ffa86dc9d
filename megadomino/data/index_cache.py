"""On-disk cache of the index arrays datasets build (document / sample / shuffle / blend indices).

Files are `CACHE_DIR/{md5 of description}-{kind}-{name}.npy` plus a `...-description.json` saying
what was built, so a change of data, seed, split, length or sample count never reuses stale
indices: descriptions name the data by what it is (`IndexedDataset.identity()`: the .idx content
hash, the .bin size and modification time), not by its path. Each file is written under a
temporary name and renamed into place, so a reader sees whole files or none, and ranks racing to
build the same indices on a shared disk are harmless. Hits are memory mapped; a cache file that
fails to load is rebuilt, with a notice naming it. A cache directory that cannot be written (a
read-only data directory) is a ConfigError naming it and --data-cache-path.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable

import numpy as np

from megadomino.config import ConfigError


def cached_arrays(cache_dir: str | None, kind: str, description: dict, names: tuple[str, ...],
                  build: Callable[[], dict[str, np.ndarray]],
                  log: Callable[[str], None] = print) -> tuple[dict[str, np.ndarray], bool]:
    """(arrays by name, whether they came from the cache). `build()` runs on a miss (or always
    when cache_dir is None) and must return exactly `names`; its arrays are then saved. A cache
    file that does not load (truncated, corrupt) is a miss, with a notice to `log`."""
    if cache_dir is None:
        return build(), False
    text = json.dumps(description, indent=2, sort_keys=True)
    stem = os.path.join(cache_dir, f"{hashlib.md5(text.encode()).hexdigest()}-{kind}")
    paths = {name: f"{stem}-{name}.npy" for name in names}
    if all(os.path.isfile(path) for path in paths.values()):
        loaded = {}
        for name, path in paths.items():
            try:
                loaded[name] = np.load(path, mmap_mode="r")
            except (OSError, ValueError, EOFError) as error:
                log(f"notice: index cache file {path} does not load ({error}): rebuilding it")
                break
        else:
            return loaded, True
    arrays = build()
    if set(arrays) != set(names):
        raise ValueError(f"{kind} index build returned {sorted(arrays)}, expected {sorted(names)}")
    try:
        os.makedirs(cache_dir, exist_ok=True)
        _write_atomically(f"{stem}-description.json", lambda f: f.write(text.encode()))
        for name, path in paths.items():
            _write_atomically(path, lambda f, array=arrays[name]: np.save(f, array))
    except OSError as err:  # a read-only data directory, a full disk, a file in the way
        raise ConfigError(f"--data-cache-path: cannot write the index cache in {cache_dir} "
                          f"({err.strerror}; by default it goes beside the first --data-path "
                          "prefix): give --data-cache-path a writable directory") from None
    return arrays, False


def _write_atomically(path: str, write: Callable) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "wb") as stream:
            write(stream)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
