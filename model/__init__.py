"""The plain PyTorch Kimi K3 (``k3compile.model``): config, model, cache, loading. Imports nothing from k3compile."""
from .cache import KDAState, KimiK3Cache, MLAState
from .config import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig
from .modeling import KimiDecoderLayer, KimiK3ForCausalLM, KimiK3ForConditionalGeneration, KimiK3TextModel
from .parallel import TPContext
from .auto import register as _register_auto

_register_auto()

__all__ = [
    "KimiK3Config", "KimiK3TextConfig", "KimiK3VisionConfig", "KimiK3ForConditionalGeneration",
    "KimiK3ForCausalLM", "KimiK3TextModel", "KimiDecoderLayer", "KimiK3Cache", "KDAState", "MLAState", "TPContext",
]
