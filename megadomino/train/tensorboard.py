"""TensorBoard scalars through torch.utils.tensorboard, on rank 0, when --tensorboard-dir is set.

The tensorboard package is optional: `open_writer` raises ConfigError naming the flag when the
flag is given and the package is missing. Every rank calls it (rank 0 alone opens a writer), so
every rank refuses alike before the first collective.
"""

from __future__ import annotations

from megadomino.config import ConfigError


class ScalarWriter:
    """`write({tag: value}, step)` adds scalars; `close()` flushes the event file."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory)

    def write(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_writer(directory: str | None, rank: int) -> ScalarWriter | None:
    """A writer into `directory` on rank 0; None elsewhere or without a directory."""
    if directory is None:
        return None
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"--tensorboard-dir={directory} needs the tensorboard package, which "
                          f"is not installed ({err}): pip install tensorboard") from None
    return ScalarWriter(directory) if rank == 0 else None
