"""Build small random-weight models locally (nothing is downloaded).

Tests, the demo and the benchmarks need a real Hugging Face checkpoint that
vLLM can serve, but no model hub is reachable at run time. We train a byte-level
BPE tokenizer on synthetic text in-process and save a Llama (or, for
multi-head latent attention, a DeepSeek-V2; for hybrid attention, sliding-window
and full-attention layers of Llama, Cohere2 or GPT-OSS) with random weights.
A ``ConfigOnlySpec`` writes the config and the tokenizer only: vLLM serves it
with ``load_format="dummy"``, making random weights in place.

Random weights at the default init give degenerate greedy output (one token
repeated), which would make "cached == uncached" checks meaningless, so the
init scale is raised until greedy continuations vary (checked by the tests).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_WORDS = (
    "pool cache block layer token prefix host device store load save key hash "
    "engine request worker scheduler memory buffer stream event copy page shard "
    "rank tensor model batch step decode prefill chunk queue thread lease master"
).split()


# Bump when the builder's output changes, so existing model folders are rebuilt.
BUILDER_VERSION = 2


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a generated model; the defaults make the tests' tiny model."""

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_positions: int = 8192
    init_std: float = 0.08
    seed: int = 0


@dataclass(frozen=True)
class MlaModelSpec(ModelSpec):
    """A DeepSeek-V2 model: multi-head latent attention, dense MLPs (no experts).

    vLLM's CPU MLA kernel takes only a 576-wide latent (kv_lora_rank 512 +
    qk_rope_head_dim 64). ``num_kv_heads`` is unused: MLA caches one latent.
    """

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32


@dataclass(frozen=True)
class HybridModelSpec(ModelSpec):
    """Sliding-window layers alternating with full-attention ones, starting with a sliding one.

    vLLM's hybrid KV cache manager makes them two KV cache groups. Architectures
    vLLM 0.32's CPU build runs with prefix caching on: ``llama`` (vLLM's Llama
    honours per-layer ``layer_types``), ``cohere2`` and ``gpt_oss`` (mixture of
    experts, attention sinks); ``mistral`` slides in every layer (one group).
    """

    architecture: str = "llama"
    sliding_window: int = 64


@dataclass(frozen=True)
class ConfigOnlySpec(ModelSpec):
    """A Llama written as config.json and a tokenizer, no weights: for vLLM's ``load_format="dummy"``,
    so a model of billions of parameters costs neither build time nor disk."""

    weights: bool = False  # in the folder's stamp, so a folder built with weights is not taken for this one


PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(),
    # One KV head: under TP every rank holds the same KV (stored once).
    "tiny_1kv": ModelSpec(num_kv_heads=1),
    # Six layers: enough for the dynamic buffer (layers time-sharing 2 buffers) to matter.
    "tiny6": ModelSpec(num_layers=6),
    # MLA: one latent per token shared by every head, so TP ranks hold identical KV.
    # A larger init widens greedy margins: a warm request's last tokens take MLA's
    # context path, which rounds differently, and at 0.08 that flipped a near tie.
    "tiny_mla": MlaModelSpec(num_layers=2, num_kv_heads=1, init_std=0.2),
    # Hybrid attention: 2 sliding-window (64 tokens) and 2 full-attention layers.
    "tiny_swa": HybridModelSpec(),
    "tiny_cohere2": HybridModelSpec(architecture="cohere2"),
    "tiny_gpt_oss": HybridModelSpec(architecture="gpt_oss", num_layers=2),
    "tiny_mistral_swa": HybridModelSpec(architecture="mistral"),
    # A few hundred million parameters: prefill costs real time on a CPU,
    # which is what a pool hit is supposed to save.
    "medium": ModelSpec(
        num_layers=16,
        hidden_size=1536,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=4096,
        vocab_size=8192,
        init_std=0.03,
    ),
    # Llama-3-8B's shape (bf16, 128 KiB of KV per token) for the GPU benchmarks; 128k positions as Llama 3.1.
    "llama3_8b": ConfigOnlySpec(
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_positions=131072,
    ),
}


def synthetic_corpus(num_lines: int, seed: int) -> list[str]:
    """Domain words mixed with random letter strings: enough distinct pairs for
    BPE to fill the whole vocabulary, so every model token id decodes to text."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word() -> str:
        if rng.random() < 0.3:
            return rng.choice(_WORDS)
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))

    return [" ".join(word() for _ in range(12)) for _ in range(num_lines)]


def build_tokenizer(out: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # 4,000 lines fill vocabularies up to ~60k tokens; larger ones need more distinct pairs.
    tok.train_from_iterator(synthetic_corpus(max(4000, vocab_size // 8), seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if len(fast) != vocab_size:
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, the model {vocab_size}")
    fast.save_pretrained(out)


def build_model(out: Path, spec: ModelSpec) -> None:
    if isinstance(spec, ConfigOnlySpec):
        from transformers import LlamaConfig

        LlamaConfig(**_common_config(spec)).save_pretrained(out)
        return
    import torch

    torch.manual_seed(spec.seed)
    if isinstance(spec, MlaModelSpec):
        model = _deepseek_v2(spec)
    elif isinstance(spec, HybridModelSpec):
        model = _hybrid(spec)
    else:
        model = _llama(spec)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if isinstance(spec, HybridModelSpec) and spec.architecture == "llama":
        # LlamaConfig does not save layer_types; vLLM's Llama reads them from config.json.
        path = out / "config.json"
        config = json.loads(path.read_text())
        config["layer_types"] = _layer_types(spec)
        path.write_text(json.dumps(config, indent=2))


def _common_config(spec: ModelSpec) -> dict[str, Any]:
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def _llama(spec: ModelSpec) -> "PreTrainedModel":
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_common_config(spec)))


def _deepseek_v2(spec: MlaModelSpec) -> "PreTrainedModel":
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        **_common_config(spec),
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        first_k_dense_replace=spec.num_layers,  # every layer a dense MLP
    )
    return DeepseekV2ForCausalLM(config)


def _layer_types(spec: HybridModelSpec) -> list[str]:
    return [("sliding_attention", "full_attention")[i % 2] for i in range(spec.num_layers)]


def _hybrid(spec: HybridModelSpec) -> "PreTrainedModel":
    import transformers

    common = _common_config(spec)
    layers = dict(sliding_window=spec.sliding_window, layer_types=_layer_types(spec))
    if spec.architecture == "llama":
        config = transformers.LlamaConfig(**common)
        config.sliding_window = spec.sliding_window
        return transformers.LlamaForCausalLM(config)
    if spec.architecture == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=spec.sliding_window)
        return transformers.MistralForCausalLM(config)
    if spec.architecture == "cohere2":
        config = transformers.Cohere2Config(**{**common, "tie_word_embeddings": True}, **layers)
        return transformers.Cohere2ForCausalLM(config)
    if spec.architecture == "gpt_oss":
        config = transformers.GptOssConfig(
            **common, head_dim=spec.hidden_size // spec.num_heads, num_local_experts=4, num_experts_per_tok=2,
            **layers,
        )
        return transformers.GptOssForCausalLM(config)
    raise ValueError(f"unknown hybrid architecture {spec.architecture!r}")


def ensure_model(out: Path, spec: ModelSpec) -> Path:
    """Build the model at `out` unless an identical one is already there."""
    out = Path(out)
    stamp = out / "vllm_aio_spec.json"
    wanted = json.dumps({**asdict(spec), "builder": BUILDER_VERSION}, sort_keys=True)
    if stamp.exists() and stamp.read_text() == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec.vocab_size, spec.seed)
    build_model(out, spec)
    stamp.write_text(wanted)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    args = parser.parse_args()
    print(ensure_model(args.out, PRESETS[args.preset]))


if __name__ == "__main__":
    main()
