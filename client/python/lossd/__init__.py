"""Python client of lossd, the linear cross-entropy server.

lossd.Client is the numpy-level client (one method per RPC); lossd.torch.RemoteHead is a
torch.nn.Module whose forward returns the loss and whose backward gives dL/dh, with W, its
gradient and its optimizer state living on the server; lossd.hf.offload_head makes a transformers
causal LM compute its loss that way in one call. lossd.torch and lossd.hf are imported on demand
so that scoring clients need neither torch nor transformers. lossd.tinker names Tinker's losses
and their configuration.
"""
from lossd._version import __version__
from lossd.client import (CLIP_DUAL, CLIP_HIGH, CLIP_LOW, CLIP_NONE, OBJECTIVES, OUTPUT_NAMES,
                          SPARSE_TEACHER_MASSES, Client, EmbeddingRows, GradNormInfo, HeadInfo,
                          LossdError, LossResult, RetryPolicy, StepInfo)
from lossd._address import Target, parse_target, replica_address
from lossd.options import DistillOptions, LossOptions, PolicyOptions, grpo_loss_type
from lossd._tensors import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from lossd import tinker

__all__ = ["__version__", "CLIP_DUAL", "CLIP_HIGH", "CLIP_LOW", "CLIP_NONE", "Client",
           "DistillOptions", "EmbeddingRows", "GradNormInfo", "HeadInfo", "LossOptions",
           "PolicyOptions", "LossdError", "LossResult", "OBJECTIVES", "OUTPUT_NAMES",
           "RetryPolicy", "SPARSE_TEACHER_MASSES", "StepInfo", "Target",
           "bfloat16_bits_to_float32", "float32_to_bfloat16_bits", "parse_target",
           "grpo_loss_type", "replica_address", "tinker"]
