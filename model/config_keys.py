"""Which config.json keys k3c reads, ignores, reports and refuses (docs/model.md §8), and the JSON type
checks that name a field: the key policy that ``K3Config`` applies to every file it reads."""
from __future__ import annotations

import json
import math
from typing import Any

from ..errors import K3Error


class ConfigError(K3Error, ValueError):
    """An invalid or unreadable model configuration; the message names the field."""


# the config's hidden_act: SiTU (K3), SiLU-GLU (Kimi Linear), those ops/numerics.py ACTIVATIONS
# computes (a test holds the two equal: this module imports no torch, ops/ does)
ACTIVATIONS = ("situ", "silu")

# transformers' and the Hub's other spellings of K3Config fields
ALIASES = {
    "num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts", "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group", "model_max_length": "max_position_embeddings",
}
# transformers' PretrainedConfig keys every saved config carries (generation defaults, export and
# task switches, token ids of the tokenizer): none sets the text model's math.
TRANSFORMERS_GENERIC = frozenset({
    "_name_or_path", "add_cross_attention", "bad_words_ids", "begin_suppress_tokens", "chunk_size_feed_forward",
    "cross_attention_hidden_size", "decoder_start_token_id", "diversity_penalty", "do_sample", "early_stopping",
    "encoder_no_repeat_ngram_size", "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id",
    "forced_eos_token_id", "id2label", "is_decoder", "is_encoder_decoder", "label2id", "length_penalty",
    "max_length", "min_length", "no_repeat_ngram_size", "num_beam_groups", "num_beams", "num_return_sequences",
    "output_attentions", "output_hidden_states", "output_scores", "prefix", "problem_type", "pruned_heads",
    "remove_invalid_values", "repetition_penalty", "return_dict", "return_dict_in_generate", "sep_token_id",
    "suppress_tokens", "task_specific_params", "temperature", "tf_legacy_loss", "tie_encoder_decoder",
    "tokenizer_class", "top_k", "top_p", "torchscript", "typical_p", "use_bfloat16", "_attn_implementation",
    "_commit_hash", "transformers_version",
})
# the multimodal wrapper's own keys (the vision tower and its placeholders; k3c runs the text model)
WRAPPER_OWN = frozenset({"ignore_index", "image_placeholder", "media_placeholder_token_id", "vision_config"})
# Keys that cannot change the text model's math, accepted knowingly and ignored: token ids, dtypes,
# provenance, generation and output switches of transformers' PretrainedConfig; rope_* (MLA uses
# NoPE: docs/model.md §2 step 4); head_dim / qk_head_dim (derived from the MLA fields); dropout (inference).
IGNORED = frozenset({
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
    "transformers_version", "use_cache", "_name_or_path", "id2label", "label2id", "problem_type",
    "return_dict", "output_attentions", "output_hidden_states", "output_router_logits",
    "chunk_size_feed_forward", "is_encoder_decoder", "rope_theta", "rope_scaling", "rope_parameters",
    "head_dim", "qk_head_dim", "attention_dropout", "media_placeholder_token_id", "vision_config",
    "text_config", "model_type",
}) | TRANSFORMERS_GENERIC | WRAPPER_OWN
# compressed-tensors keys k3c reads or knows to be inert, at each level of ``quantization_config``;
# any other key there could change how the weights decode and is refused
QUANT_KEYS = frozenset({"quant_method", "format", "config_groups", "ignore", "group_size", "global_compression_ratio",
                        "kv_cache_scheme", "quantization_status", "sparsity_config", "transform_config", "version"})
QUANT_GROUP_KEYS = frozenset({"targets", "weights", "format", "input_activations", "output_activations"})
QUANT_WEIGHT_KEYS = frozenset({"num_bits", "type", "strategy", "group_size", "symmetric", "scale_dtype", "dynamic",
                               "actorder", "block_structure", "observer", "observer_kwargs", "zp_dtype"})
WRAPPER_KEYS = IGNORED | {"quantization_config", "tie_word_embeddings"}   # K3 release top level (docs/model.md §8)
def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON's true/false are not numbers here


KIND_CHECKS = {
    "None": lambda v: v is None,
    "int": is_int,
    "float": lambda v: (is_int(v) or isinstance(v, float)) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "dict": lambda v: isinstance(v, dict),
    "list[int]": lambda v: isinstance(v, list) and all(map(is_int, v)),
}
TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
              "None": "null", "dict": "an object", "list[int]": "a list of integers"}


def _kinds(annotation: str) -> list[str]:
    """``"dict[str, Any] | None"`` -> ["dict", "None"]."""
    return [k.strip().split("[str")[0] for k in annotation.split("|")]


def need_type(name: str, value: Any, annotation: str) -> None:
    """A JSON value must have the type a field's annotation names; the error names field and type."""
    if not any(KIND_CHECKS[k](value) for k in _kinds(annotation)):
        want = " or ".join(TYPE_WORDS[k] for k in _kinds(annotation))
        raise ConfigError(f"config field '{name}': expected {want}, got {json.dumps(value, default=repr)}")


def unknown_keys(raw: dict[str, Any], known: set[str] | frozenset[str], where: str = "") -> list[str]:
    """The keys of ``raw`` outside ``known``, named by their path (``where`` is the parent's)."""
    return [f"{where}{k}" for k in sorted(set(raw) - known)]


def refuse(problems: list[str]) -> None:
    """Every problem of a config in one ConfigError, each naming its field."""
    if problems:
        raise ConfigError("; ".join(problems))
