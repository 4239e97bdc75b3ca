"""Which dtype the weights and the KV pool are served in.

The weights keep the checkpoint's dtype unless the operator names another: config.json's `torch_dtype`
(transformers 5 writes `dtype`), else the tensors' own dtype in the safetensors headers. The KV pool follows the
weights unless named. A bf16 checkpoint served in float32 takes twice its memory and gains nothing it was
trained with.
"""
from __future__ import annotations

import torch

from .config import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ["auto", *DTYPES]
# the safetensors header names of the float dtypes that may be served; every other one (ints, float8, ...) is
# quantized or not a weight, and refused by the loader as "not floating point"
SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class DtypeError(CheckpointError):
    """A dtype the engine cannot decide or serve: the CLI prints the message, no traceback."""


def weight_dtype(requested: str, config_dtype: str | None, file_dtypes: set[str]) -> str:
    """requested: 'auto' or a DTYPES name; config_dtype: config.json's torch_dtype (None if absent);
    file_dtypes: the float dtype names the checkpoint's tensors are stored in."""
    if requested != "auto":
        if requested not in DTYPES:
            raise DtypeError(f"--dtype {requested!r} is not one of {', '.join(CHOICES)}")
        return requested
    if config_dtype is not None:
        if config_dtype not in DTYPES:
            raise DtypeError(f"config.json torch_dtype {config_dtype!r} is not served (served: "
                             f"{', '.join(DTYPES)}); pass --dtype to convert")
        return config_dtype
    served = file_dtypes & DTYPES.keys()
    if len(file_dtypes) == 1 and served:
        return served.pop()
    raise DtypeError(f"config.json states no torch_dtype and the tensors are stored in {sorted(file_dtypes) or 'none'}"
                     f": pass --dtype ({', '.join(DTYPES)})")


def kv_dtype(requested: str, weights: str) -> str:
    if requested == "auto":
        return weights
    if requested not in DTYPES:
        raise DtypeError(f"--kv-cache-dtype {requested!r} is not one of {', '.join(CHOICES)}")
    return requested
