"""The plain PyTorch Kimi K3 (``k3compile.model``): config, model, cache, loading, vision, processor, MTP.
Imports nothing from k3compile."""
from .cache import KDAState, KimiK3Cache, MLAState
from .config import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig
from .modeling import KimiDecoderLayer, KimiK3ForCausalLM, KimiK3ForConditionalGeneration, KimiK3TextModel
from .mtp import KimiK3MultiTokenPredictor, SpeculativeResult, speculative_generate
from .parallel import TPContext
from .processing import KimiK3ImageProcessor, KimiK3Processor
from .vision import MoonViT, PatchMergerV2
from .auto import register as _register_auto

_register_auto()

__all__ = [
    "KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig", "KimiK3ForConditionalGeneration",
    "KimiK3ForCausalLM", "KimiK3TextModel", "KimiDecoderLayer", "KimiK3Cache", "KDAState", "MLAState", "TPContext",
    "MoonViT", "PatchMergerV2", "KimiK3Processor", "KimiK3ImageProcessor", "KimiK3MultiTokenPredictor",
    "SpeculativeResult", "speculative_generate", "memory_plan", "MemoryPlan",
]


def __getattr__(name: str):
    # the memory plan loads on first use, so that ``python -m k3compile.model.plan`` runs the module fresh
    if name in ("memory_plan", "MemoryPlan"):
        from . import plan
        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
