"""The sampling section of the experiment config: the rollout's step kernel, guidance, group
geometry and the token families' logit transform (its own module: the schema's largest section)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: T2I-R1's reasoning prompt (data/prompt/reasoning_prompt.txt), with {prompt} for its "{}"
T2I_R1_REASONING_PROMPT = (
    'You are asked to generate an image based on this prompt: "{prompt}"\n'
    "Provide a brief, precise visualization of all elements in the prompt. Your description should:\n"
    "1. Include every object mentioned in the prompt\n"
    "2. Specify visual attributes (color, number, shape, texture) if specified in the prompt\n"
    "3. Clarify relationships (e.g., spatial) between objects if specified in the prompt\n"
    "4. Be concise (50 words or less)\n"
    "5. Focus only on what's explicitly stated in the prompt\n"
    "6. Do not elaborate beyond the attributes or relationships specified in the prompt\n"
    "Do not miss objects. Output your visualization directly without explanation: ")


class SamplingConfig(_Section):
    steps: int = Field(10, ge=1)
    noise_level: float = Field(0.7, ge=0)
    sde_type: Literal["sde", "cps", "dance", "ddim"] = Field(
        "sde", description="stochastic step kernel: Flow-GRPO's SDE, CPS, DanceGRPO's (s_t ≡ η) or DDPO's DDIM-η")
    guidance_scale: float = Field(1.0, ge=1.0)
    negative_prompt: str = Field("", description="classifier-free guidance's unconditional prompt (guidance_scale > 1; "
                                 "empty: the empty prompt, as the pipelines default); encoded as the family's pipeline "
                                 "encodes its negative_prompt, and recorded in each row's recipe")
    cfg_truncation: float = Field(1.0, gt=0, le=1.0, description="classifier-free guidance only at steps k with "
                                  "(k + 1)/steps ≤ this, the conditional velocity after (Lumina2Pipeline's "
                                  "cfg_trunc_ratio; 1: every step)")
    group_size: int = Field(8, ge=2, description="G samples per prompt")
    prompts_per_iteration: int = Field(8, ge=1)
    max_rounds: int = Field(1, ge=1, description="DAPO dynamic sampling: further rounds of prompts_per_iteration "
                            "groups until that many have unequal rewards, at most this many; train on the first (1: one)")
    micro_batch: int = Field(16, ge=1, description="rollout and replay batch (same geometry → ratio 1)")
    timestep_fraction: float = Field(0.99, gt=0, le=1.0)
    window_size: int | None = Field(None, ge=1, description="Flow-GRPO-Fast: SDE only in a window of this size")
    window_range: tuple[int, int] | None = None
    window_shape: Literal["contiguous", "scattered"] = Field("contiguous", description="the window's steps: contiguous "
                                                             "(Flow-GRPO-Fast), or drawn anywhere in window_range (UniRL)")
    eval_steps: int = Field(20, ge=1)
    temperature: float = Field(1.0, gt=0, description="token families: softmax temperature of the image tokens")
    top_k: int = Field(0, ge=0, description="token families: sample among the k likeliest tokens (0: all)")
    cot_tokens: int = Field(0, ge=0, description="token families: a semantic chain of thought of at most this many "
                            "text tokens before the image (T2I-R1's BiCoT; 0: none)")
    cot_temperature: float = Field(1.0, gt=0, description="token families: softmax temperature of the chain of thought")
    cot_template: str = Field(T2I_R1_REASONING_PROMPT, description="token families: the reasoning prompt the chain of "
                              "thought answers, with {prompt}")
    cot_backend: Literal["policy", "vllm"] = Field("policy", description="what samples the chain of thought: the "
                                                   "policy in this process, or a vLLM server of its language model "
                                                   "(engines/vllm_text.py; log-probs stay the policy's)")
    cot_vllm_url: str = Field("", description="cot_backend=vllm: the server `pixrl serve-vllm-text` started")
    cot_vllm_model: str = Field("", description="cot_backend=vllm: the served model's name (empty: the only one)")
    cot_vllm_weights: Literal["broadcast", "files"] = Field(
        "broadcast", description="cot_backend=vllm: how each policy version reaches the server: broadcast over a "
        "process group of its own (gloo on CPU, NCCL on CUDA) through vLLM's weight-update API and pixrl's backend "
        "(engines/vllm_weights.py; `pixrl serve-vllm-text` enables it), or files: safetensors under the run's "
        "workdir that the server reloads (a disk both see)")
    cot_vllm_address: str = Field("", description="cot_backend=vllm, weights broadcast: this process's address as "
                                  "the server dials it (empty: the one on the route to the server)")

    @field_validator("negative_prompt", mode="before")
    @classmethod
    def _empty_negative(cls, value):
        """`sampling.negative_prompt=` on the command line parses as null: the empty prompt."""
        return "" if value is None else value

    @model_validator(mode="after")
    def _slots(self) -> SamplingConfig:
        if self.cot_tokens and "{prompt}" not in self.cot_template:
            raise ValueError("sampling.cot_template must contain {prompt} (where the image prompt goes)")
        if self.cot_backend == "vllm" and not (self.cot_tokens and self.cot_vllm_url):
            raise ValueError(f"sampling.cot_backend=vllm samples the chain of thought on a vLLM server: it needs "
                             f"sampling.cot_tokens > 0 (got {self.cot_tokens}) and sampling.cot_vllm_url (got "
                             f"{self.cot_vllm_url!r}; `pixrl serve-vllm-text` prints it)")
        if self.cfg_truncation < 1 and self.guidance_scale <= 1:
            raise ValueError(f"sampling.cfg_truncation={self.cfg_truncation} truncates classifier-free guidance, and "
                             f"sampling.guidance_scale={self.guidance_scale} samples without it: set guidance_scale "
                             f"> 1 or cfg_truncation=1")
        if self.negative_prompt and self.guidance_scale <= 1:
            raise ValueError(f"sampling.negative_prompt={self.negative_prompt!r} is only used by classifier-free "
                             f"guidance, and sampling.guidance_scale={self.guidance_scale} samples without it: set "
                             f"guidance_scale > 1 or drop the negative prompt (a reference guided after CFG-free "
                             f"rollouts — algorithm.kl_guidance of dgpo and crd — is guided by the empty prompt)")
        if self.window_size:  # refused here, before a run opens, not at its first generate
            lo, hi = self.window_range or (0, self.steps // 2)
            if lo < 0 or hi - lo < self.window_size or hi > self.steps:
                raise ValueError(f"sampling.window_range={[lo, hi]} cannot hold a window of {self.window_size} SDE "
                                 f"steps within sampling.steps={self.steps}: set window_range to [lo, hi] with "
                                 f"0 ≤ lo, hi − lo ≥ window_size and hi ≤ steps")
        if self.prompts_per_iteration * self.max_rounds > 1000:  # sample ids hold 3-digit group slots
            raise ValueError(f"sampling.prompts_per_iteration × sampling.max_rounds = "
                             f"{self.prompts_per_iteration * self.max_rounds} groups per iteration; at most 1000")
        return self
