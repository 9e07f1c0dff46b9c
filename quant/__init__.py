"""How weights are stored: GGML block formats and the kernels that compute with them."""
from .types import (BLOCK_LAYOUT, SUPPORTED, TYPE_INFO, GGMLType, UnsupportedQuantType, row_nbytes,
                    tensor_nbytes, type_name)
