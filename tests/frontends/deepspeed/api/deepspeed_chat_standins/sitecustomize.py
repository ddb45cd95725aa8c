"""DeepSpeed-Chat was written for transformers 4, where `no_init_weights` lived in
`transformers.modeling_utils`; transformers 5 moved it to `transformers.initialization`.
For the DeepSpeed-Chat test runs only (this directory is first on their PYTHONPATH), the
old name is given back, so the scripts stay byte-identical. Nothing DeepSpeed-related."""

import transformers.initialization
import transformers.modeling_utils

transformers.modeling_utils.no_init_weights = transformers.initialization.no_init_weights
