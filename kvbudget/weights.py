"""Weight precision: serve the checkpoint as stored, or let vLLM quantize its weights to FP8 as it loads them.

vLLM's `--quantization fp8` on a 16-bit checkpoint (Fp8Config with an unserialised checkpoint) rounds
every linear layer's weight, the MoE experts' included, to float8_e4m3 with one scale per tensor, as the
weights are loaded. The embeddings and the LM head are not linear layers there and stay in 16 bits. On
a card with FP8 tensor cores (compute capability 8.9 and newer) the products run in FP8; from 7.5 to 8.9
vLLM runs the same weights through its weight-only Marlin kernel (memory saved, no faster products);
below 7.5 it refuses (Fp8Config.get_min_capability). Its CPU build has no FP8 quantize kernel
(`_C::static_scaled_fp8_quant` is an empty placeholder there): a CPU host gets an integer build made by
`appliance model quantize` instead.

The planner (kvbudget.planner) asks this module what each choice weighs and which one a target allows;
under `auto` it plans both and keeps FP8 only where it fits a model that does not fit otherwise, or buys
at least `fp8_weights_gain` more sessions at the target context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvbudget.model import ModelShape
    from kvbudget.profiles import GpuProfile

WeightTarget = Literal["auto", "model", "fp8"]
Scheme = Literal["model", "fp8"]

# vLLM's Fp8Config.get_min_capability() (tests/integration/test_kvbudget_vs_vllm.py compares the two).
FP8_MIN_CAPABILITY = (7, 5)

QUALITY_NOTE = ("FP8 weights at load are rounded with one scale per tensor and no calibration: expect a small "
                "loss against the 16-bit model; for per-channel scales and a build checked on the site's own "
                "questions, make one with `appliance model quantize --scheme fp8-dynamic` (it refuses a build "
                "that loses more than its bound) and serve that instead")


@dataclass(frozen=True)
class WeightChoice:
    """How the engine holds the weights: what it costs, why it was chosen, what the other choice gives."""

    scheme: Scheme  # "model": as the checkpoint stores them; "fp8": vLLM quantizes them at load
    bytes: int  # the whole model's weight bytes in that form (before tensor parallel splits them)
    reason: str
    quality: str | None = None  # what the choice gives up
    alternative: str | None = None  # the other choice, in the plan's own figures

    @property
    def args(self) -> tuple[str, ...]:
        return ("--quantization", "fp8") if self.scheme == "fp8" else ()


def stored_16bit(model: ModelShape) -> bool:
    """A checkpoint vLLM can quantize at load: unquantized, in a 16-bit dtype."""
    return not model.weight_format and not model.quantization and model.dtype_bytes == 2


def embedding_bytes(model: ModelShape) -> int:
    """The input embedding and (untied) LM head: vLLM keeps them in the model dtype under FP8."""
    return model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2) * model.dtype_bytes


def fp8_bytes(model: ModelShape) -> int:
    """The weights after vLLM's load-time FP8: one byte for each linear weight, the embeddings as they
    were. Norms, biases and per-tensor scales (a few bytes per layer) are counted with the linear part,
    so this is, if anything, a little high."""
    embed = min(embedding_bytes(model), model.weight_bytes)
    return embed + (model.weight_bytes - embed) // model.dtype_bytes


def fp8_refusal(model: ModelShape, gpu: GpuProfile, cpu: bool) -> str | None:
    """Why vLLM cannot quantize this model's weights to FP8 at load on this device, or None."""
    if cpu:
        return ("vLLM's CPU build cannot quantize weights to FP8 at load (its FP8 quantize kernel is an empty "
                "placeholder there) and has no fast FP8 matrix kernel: for a CPU host, build w8a8-int8 or w4a16 "
                "with `appliance model quantize` and serve that folder")
    if not stored_16bit(model):
        what = model.weight_format or model.quantization or f"{model.dtype_bytes}-byte weights"
        return (f"{model.name} is not a 16-bit checkpoint ({what}): vLLM quantizes only BF16/FP16 weights at "
                "load; serve it as stored (targets.weights = \"model\")")
    if gpu.compute_capability < FP8_MIN_CAPABILITY:
        have = "%d.%d" % gpu.compute_capability
        need = "%d.%d" % FP8_MIN_CAPABILITY
        return (f"vLLM's FP8 weight quantization needs compute capability {need} or newer (its words: "
                f"\"Minimum capability: {need.replace('.', '')}\"); {gpu.name} is {have}")
    return None


def as_stored(model: ModelShape, reason: str, alternative: str | None = None) -> WeightChoice:
    return WeightChoice("model", model.weight_bytes, reason, alternative=alternative)


def fp8(model: ModelShape, gpu: GpuProfile, reason: str, alternative: str | None = None) -> WeightChoice:
    quality = QUALITY_NOTE
    if not gpu.fp8:
        quality += (f"; {gpu.name} has no FP8 tensor cores, so vLLM runs them weight-only (Marlin): memory is "
                    "saved, the products are no faster")
    return WeightChoice("fp8", fp8_bytes(model), reason, quality, alternative)
