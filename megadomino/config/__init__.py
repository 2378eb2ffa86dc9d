"""The configuration tree, typed sections under Megatron-LM's field names:

    Config
      model: ModelConfig          the architecture (config/model.py, with the presets)
      parallel: ParallelConfig    degrees, sequence parallelism, the one TP overlap (none /
                                  fused SP communication / Domino with its DominoPlan), CUDA
                                  graphs, recompute, the data-parallel engine (ZeroConfig)
                                  and DiLoCo's outer optimizer across sites (DilocoConfig)
      train: TrainConfig          optimizer, schedule, precision (FP8Recipe), data, checkpoint,
                                  logging, runtime (config/train.py)

Each field has one default whatever the entry point. `validate(config)` (config/validate.py) is
the one validator: the command line and the library run it before any collective, and every rank
refuses a bad configuration with the same line naming the flag.
"""

from megadomino.config.check import ConfigError, check
from megadomino.config.diloco import DilocoConfig
from megadomino.config.model import ARCHITECTURES, FAMILY_DEFAULTS, PRESETS, ModelConfig
from megadomino.config.parallel import DominoPlan, ParallelConfig
from megadomino.config.train import (
    CheckpointConfig,
    DataConfig,
    FP8Recipe,
    LoggingConfig,
    OptimizerConfig,
    PrecisionConfig,
    RuntimeConfig,
    ScheduleConfig,
    TrainConfig,
)
from megadomino.config.tree import Config, build
from megadomino.config.zero import REDUCE_DTYPES, ZeroConfig

__all__ = [
    "ARCHITECTURES", "FAMILY_DEFAULTS", "PRESETS", "REDUCE_DTYPES", "CheckpointConfig", "Config",
    "ConfigError", "DataConfig", "DilocoConfig", "DominoPlan", "FP8Recipe", "LoggingConfig",
    "ModelConfig", "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "RuntimeConfig",
    "ScheduleConfig", "TrainConfig", "ZeroConfig", "build", "check",
]
