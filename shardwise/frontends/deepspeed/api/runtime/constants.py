"""`deepspeed.runtime.constants`: the config's key names and their defaults as DeepSpeed
0.19.8 defines them (`TRAIN_BATCH_SIZE = "train_batch_size"`, `..._DEFAULT`), the
engine's forward routes (`ROUTE_TRAIN`, ...) and `PIPE_REPLICATED`, the attribute
pipeline scripts set on tied parameters. Scripts read these to build or inspect configs
(`config[TRAIN_BATCH_SIZE]`) or compare against DeepSpeed's defaults
(`GRADIENT_CLIPPING_DEFAULT`, `SCHEDULER_TYPE_DEFAULT`); the values are checked against
DeepSpeed's own module in tests/frontends/deepspeed/api/runtime/test_constants.py.

The sequence-parallel communication type's default is DeepSpeed's for every device but
CUDA with NCCL >= 2.27.3 (where DeepSpeed leaves it None): "fp32".
"""

from shardwise.frontends.deepspeed.data_loader import ROUTE_EVAL, ROUTE_PREDICT, ROUTE_TRAIN

ROUTE_ENCODE = "encode"

TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_BATCH_SIZE_DEFAULT = None

OPTIMIZER = "optimizer"
OPTIMIZER_TYPE_DEFAULT = None
OPTIMIZER_PARAMS = "params"
TYPE = "type"
LEGACY_FUSION = "legacy_fusion"
LEGACY_FUSION_DEFAULT = False
SCHEDULER = "scheduler"
SCHEDULER_TYPE_DEFAULT = None
SCHEDULER_PARAMS = "params"
MAX_GRAD_NORM = "max_grad_norm"

ZERO_ALLOW_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"
ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT = False
ZERO_FORCE_DS_CPU_OPTIMIZER = "zero_force_ds_cpu_optimizer"
ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT = True

STEPS_PER_PRINT = "steps_per_print"
STEPS_PER_PRINT_DEFAULT = None

TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = None

GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_ACCUMULATION_STEPS_DEFAULT = None

MANAGED_GRADIENT_ACCUMULATION = "managed_gradient_accumulation"
MANAGED_GRADIENT_ACCUMULATION_DEFAULT = True

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
BFLOAT16_ENABLED = "enabled"
BFLOAT16_ENABLED_DEFAULT = False
CHECK_OVERFLOW = "check_overflow"
BFLOAT16_CHECK_OVERFLOW_DEFAULT = False

BFLOAT16_IMMEDIATE_GRAD_UPDATE = "immediate_grad_update"
BFLOAT16_IMMEDIATE_GRAD_UPDATE_DEFAULT = True

BFLOAT16_MASTER_WEIGHTS_AND_GRADS = "bf16_master_weights_and_grads"
BFLOAT16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = False
BFLOAT16_OPTIMIZER_STATES = "bf16_optimizer_states"
BFLOAT16_OPTIMIZER_STATES_DEFAULT = False

DDP_BFLOAT16 = "ddp_bf16"

FP16 = "fp16"
FP16_ENABLED = "enabled"
FP16_ENABLED_DEFAULT = False

FP16_LOSS_SCALE = "loss_scale"
FP16_LOSS_SCALE_DEFAULT = 0
FP16_AUTO_CAST = "auto_cast"
FP16_AUTO_CAST_DEFAULT = False

FP16_INITIAL_SCALE_POWER = "initial_scale_power"
FP16_INITIAL_SCALE_POWER_DEFAULT = 16

FP16_LOSS_SCALE_WINDOW = "loss_scale_window"
FP16_LOSS_SCALE_WINDOW_DEFAULT = 1000

FP16_HYSTERESIS = "hysteresis"
FP16_HYSTERESIS_DEFAULT = 2

FP16_CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
FP16_CONSECUTIVE_HYSTERESIS_DEFAULT = False

FP16_MIN_LOSS_SCALE = "min_loss_scale"
FP16_MIN_LOSS_SCALE_DEFAULT = 1

FP16_MASTER_WEIGHTS_AND_GRADS = "fp16_master_weights_and_grads"
FP16_MASTER_WEIGHTS_AND_GRADS_DEFAULT = False

TORCH_AUTOCAST = "torch_autocast"
TORCH_AUTOCAST_ENABLED = "enabled"
TORCH_AUTOCAST_ENABLED_DEFAULT = False
TORCH_AUTOCAST_DTYPE = "dtype"
TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES = "lower_precision_safe_modules"

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = 1.0

COMMUNICATION_DATA_TYPE = "communication_data_type"
COMMUNICATION_DATA_TYPE_DEFAULT = None

SEQ_PARALLEL_COMMUNICATION_DATA_TYPE = "seq_parallel_communication_data_type"
SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT = "fp32"

PRESCALE_GRADIENTS = "prescale_gradients"
PRESCALE_GRADIENTS_DEFAULT = False
GRADIENT_PREDIVIDE_FACTOR = "gradient_predivide_factor"
GRADIENT_PREDIVIDE_FACTOR_DEFAULT = 1.0
GRADIENT_ALLREDUCE_OP = "gradient_allreduce_op"
GRADIENT_ALLREDUCE_OP_MEAN = "mean"
GRADIENT_ALLREDUCE_OP_SUM = "sum"
GRADIENT_ALLREDUCE_OP_DEFAULT = "mean"
GRADIENT_ALLREDUCE_OP_SUPPORTED = ("mean", "sum")

DISABLE_ALLGATHER = "disable_allgather"
DISABLE_ALLGATHER_DEFAULT = False

DUMP_STATE = "dump_state"
DUMP_STATE_DEFAULT = False

DISABLE_PYTHON_GC = "disable_python_gc"
DISABLE_PYTHON_GC_DEFAULT = False

VOCABULARY_SIZE = "vocabulary_size"
VOCABULARY_SIZE_DEFAULT = None

WALL_CLOCK_BREAKDOWN = "wall_clock_breakdown"
WALL_CLOCK_BREAKDOWN_DEFAULT = False
MEMORY_BREAKDOWN = "memory_breakdown"
MEMORY_BREAKDOWN_DEFAULT = False


class ValidationMode:
    """How a checkpoint's tag is checked across ranks (`checkpoint.tag_validation`)."""

    WARN = "WARN"
    IGNORE = "IGNORE"
    FAIL = "FAIL"


CHECKPOINT = "checkpoint"
CHECKPOINT_TAG_VALIDATION = "tag_validation"
CHECKPOINT_TAG_VALIDATION_DEFAULT = ValidationMode.WARN
CHECKPOINT_TAG_VALIDATION_MODES = [ValidationMode.WARN, ValidationMode.IGNORE, ValidationMode.FAIL]
LOAD_UNIVERSAL_CHECKPOINT = "load_universal"
LOAD_UNIVERSAL_CHECKPOINT_DEFAULT = False
USE_NODE_LOCAL_STORAGE_CHECKPOINT = "use_node_local_storage"
USE_NODE_LOCAL_STORAGE_CHECKPOINT_DEFAULT = False
CHECKPOINT_PARALLEL_WRITE = "parallel_write"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE = "pipeline_stage"
CHECKPOINT_PARALLEL_WRITE_PIPELINE_STAGE_DEFAULT = False

DATA_TYPES = "data_types"
GRAD_ACCUM_DTYPE = "grad_accum_dtype"
GRAD_ACCUM_DTYPE_DEFAULT = None
PARAM_DTYPE = "param_dtype"
PARAM_DTYPE_DEFAULT = None
BUFFER_DTYPE = "buffer_dtype"
BUFFER_DTYPE_DEFAULT = None
KEEP_IN_FP32_MODULES = "keep_in_fp32_modules"
KEEP_IN_FP32_MODULES_DEFAULT = "auto"

DATALOADER_DROP_LAST = "dataloader_drop_last"
DATALOADER_DROP_LAST_DEFAULT = False

PIPE_REPLICATED = "ds_pipe_replicated"

DATA_PARALLEL_GROUP = "data_parallel_group"
GLOBAL_RANK = "global_rank"

USE_DATA_BEFORE_EXPERT_PARALLEL = "use_data_before_expert_parallelism"
USE_DATA_BEFORE_EXPERT_PARALLEL_DEFAULT = False
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = None
