"""LoRA on a trained module, whether or not its class carries diffusers' adapter API: most diffusers
models are a `PeftAdapterMixin` (`add_adapter`, `disable_adapters`), some are not (PixArt-Σ's
PixArtTransformer2DModel). Those get peft's own injection with the same bookkeeping (`peft_config`,
the adapter named "default") and are switched off layer by layer, so the policy, the reference
(adapters off) and the export treat every module alike."""

from __future__ import annotations

from contextlib import contextmanager

import torch


def add_lora(module: torch.nn.Module, config) -> None:
    """Inject the LoRA adapter `config` (a peft LoraConfig) as "default" and make it active."""
    if hasattr(module, "add_adapter"):
        module.add_adapter(config)
        return
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, module, adapter_name="default")
    module.peft_config = {"default": config}
    module._hf_peft_config_loaded = True


@contextmanager
def adapters_off(module: torch.nn.Module):
    """The module as its base model for the duration: every LoRA layer bypassed, then restored."""
    if hasattr(module, "disable_adapters"):
        module.disable_adapters()
        try:
            yield
        finally:
            module.enable_adapters()
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
