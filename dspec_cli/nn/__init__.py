"""Model building blocks for drafters: the parallel block backbone (DFlash / DSpark), its
attention and rotary helpers, the DSpark sequential and confidence heads, and linear layers
with packed CPU weights. Public API for plugins, ours and third parties'."""

from dspec_cli.nn.backbone import (
    LAYER_STYLES,
    MLP,
    BackboneConfig,
    Blocks,
    ContextCache,
    DecoderLayer,
    GemmaRMSNorm,
    InjectedAttention,
    ParallelBackbone,
    RMSNorm,
    Rotary,
    apply_rotary,
    attend,
    build_blocks,
    build_target_layer_ids,
    resolve_backbone_config,
    sample_anchors,
    training_mask,
)
from dspec_cli.nn.heads import (
    ConfidenceHead,
    MarkovHead,
    RNNHead,
    SequentialHead,
    build_head,
)
from dspec_cli.nn.linear import Linear, PackedWeight

__all__ = [
    "LAYER_STYLES", "MLP", "BackboneConfig", "Blocks", "ConfidenceHead", "ContextCache", "DecoderLayer",
    "GemmaRMSNorm", "InjectedAttention", "Linear", "MarkovHead", "PackedWeight", "ParallelBackbone", "RMSNorm",
    "RNNHead", "Rotary", "SequentialHead", "apply_rotary", "attend", "build_blocks", "build_head", "build_target_layer_ids",
    "resolve_backbone_config", "sample_anchors", "training_mask",
]
