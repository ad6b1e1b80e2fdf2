"""Registration with transformers' Auto classes, so that a directory holding the published ``config.json``
(``model_type: kimi_k3``) builds *our* config and model. The published text config says ``kimi_linear``; it only
ever goes through ``KimiK3Config``, which builds ``KimiK3TextConfig`` from it, never transformers' Kimi Linear
config (which would silently drop K3's AttnRes, latent MoE, SiTU and gate lower bound)."""
from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from .config import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig
from .modeling import KimiK3ForConditionalGeneration

_done = False


def register() -> None:
    global _done
    if _done:
        return
    AutoConfig.register(KimiK3Config.model_type, KimiK3Config, exist_ok=True)
    AutoConfig.register(KimiK3TextConfig.model_type, KimiK3TextConfig, exist_ok=True)
    AutoConfig.register(KimiK3VisionConfig.model_type, KimiK3VisionConfig, exist_ok=True)
    AutoModelForCausalLM.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
    try:  # the multimodal Auto class, where this transformers has it
        from transformers import AutoModelForImageTextToText
        AutoModelForImageTextToText.register(KimiK3Config, KimiK3ForConditionalGeneration, exist_ok=True)
    except ImportError:
        pass
    _done = True
