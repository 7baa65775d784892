"""Checks shared by several op families; real and Meta kernels run them alike."""

from __future__ import annotations

import torch


def _check_same_dtype(op_name: str, output: torch.Tensor, input: torch.Tensor) -> None:
    torch._check(
        output.dtype == input.dtype,
        lambda: f"fsdp::{op_name}: output is {output.dtype}, the input {input.dtype}",
    )
