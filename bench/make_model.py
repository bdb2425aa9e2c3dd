"""`kvgate make-model DIR`: write a tiny Llama model directory that the simulator and a real vLLM both serve.

The tokenizer is a byte-level BPE trained locally on this Python's own stdlib sources (a fixed, sorted file
list), so no download is needed and the same interpreter always produces byte-identical files. With
`--with-weights` a random-weight safetensors checkpoint (fixed seed) is written too; that needs torch, which
lives in the vLLM venv (`scripts/vllm-env.sh`), so the weights are made by re-running this file with that
venv's Python when the current interpreter has no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV_PYTHON = ROOT / ".cache" / "vllm-venv" / "bin" / "python"

VOCAB_SIZE = 4096
MAX_MODEL_LEN = 2048
WEIGHTS_SEED = 1234
WEIGHTS_FILE = "model.safetensors"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BOS_TOKEN = "<s>"
EOS_TOKEN = IM_END
# order = token ids 0..3
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, BOS_TOKEN]

# ChatML with a leading BOS, so a chat tokenized with add_special_tokens=True (a common router bug) would
# visibly differ from vLLM's ids by a doubled BOS. Tools render into the system turn, as Qwen templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{{ '\\n<tool_call>\\n' + (tool_call.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


# The model's shape. `tiny` (what every test and benchmark serves): a forward pass so small that a request's cost is
# vLLM's own overhead, and its KV bytes per FLOP of forward pass about 36 times Llama-3.1-8B's. `wide`: a scaled-down
# Llama (8x grouped-query attention, Llama's MLP ratio) whose forward pass is most of a request on a CPU replica and
# whose KV bytes per FLOP are about twice Llama-3.1-8B's (`forward_costs`), for measuring what the KV connector
# costs a replica whose forward pass is a realistic share of the work.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32},
    "wide": {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 4, "num_attention_heads": 16,
             "num_key_value_heads": 2, "head_dim": 64},
}
# Llama-3.1-8B's shape, for comparison only (bf16 KV): 128 KiB of KV per token, about 15 GFLOP per token
LLAMA_3_1_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256}


def forward_costs(shape: dict[str, int]) -> tuple[int, int]:
    """(KV bytes per token in bf16, forward-pass FLOPs per token in the weight matmuls: 2 per multiply-add,
    attention over the context not counted) of a Llama of this shape."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return layers * 2 * kv * 2, 2 * (layers * per_layer + h * shape.get("vocab_size", VOCAB_SIZE))


def llama_config(shape: str = "tiny") -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_SHAPES[shape],
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_MODEL_LEN,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": "bfloat16",
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
    }


def corpus_files() -> list[Path]:
    """The training corpus: top-level modules of this interpreter's stdlib, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise RuntimeError(f"no stdlib sources found under {stdlib}")
    return files


def _read_corpus() -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in corpus_files()]


def train_tokenizer() -> str:
    """Train the byte-level BPE and return tokenizer.json's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_read_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0", pair=f"{BOS_TOKEN} $A:0 $B:1", special_tokens=[(BOS_TOKEN, bos_id)],
    )
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab {tokenizer.get_vocab_size()} exceeds {VOCAB_SIZE}")
    text: str = tokenizer.to_str(pretty=True)
    return text


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_MODEL_LEN,
        "added_tokens_decoder": {
            str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def bench_model_dir(model_dir: str | None = None) -> Path:
    """The model whose tokenizer a benchmark's prompts are made with: `model_dir`, else the tiny model under
    .cache/bench-model (written the first time it is needed)."""
    if model_dir:
        return Path(model_dir)
    path = ROOT / ".cache" / "bench-model"
    if not (path / "tokenizer.json").exists():
        write_model(path)
    return path


def write_model(out: Path, shape: str = "tiny") -> list[Path]:
    """Write config (of a `MODEL_SHAPES` shape), tokenizer and generation config into `out`; returns the files
    written."""
    out.mkdir(parents=True, exist_ok=True)
    written = {
        "config.json": llama_config(shape),
        "tokenizer_config.json": tokenizer_config(),
        "generation_config.json": generation_config(),
    }
    for name, obj in written.items():
        _write_json(out / name, obj)
    (out / "tokenizer.json").write_text(train_tokenizer(), encoding="utf-8")
    return [out / n for n in (*written, "tokenizer.json")]


def write_weights(out: Path) -> Path:
    """Random-weight checkpoint (bf16, normal(0, initializer_range), norms = 1), seeded; needs torch."""
    import torch
    from safetensors.torch import save_file

    cfg = llama_config()
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (nh * hd, h)),
            (p + "self_attn.k_proj.weight", (nkv * hd, h)),
            (p + "self_attn.v_proj.weight", (nkv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, nh * hd)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    gen = torch.Generator().manual_seed(WEIGHTS_SEED)
    tensors: dict[str, Any] = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.float32)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, cfg["initializer_range"], generator=gen)
        tensors[name] = t.to(torch.bfloat16).contiguous()
    path = out / WEIGHTS_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _has_torch() -> bool:
    try:
        import safetensors.torch  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def make_weights(out: Path, python: str | None = None) -> Path:
    """Write the checkpoint here if torch is importable, else with the vLLM venv's Python (or `python`)."""
    if python is None and _has_torch():
        return write_weights(out)
    interpreter = python or str(VLLM_VENV_PYTHON)
    if not Path(interpreter).exists():
        raise RuntimeError(f"--with-weights needs torch: none here and no {interpreter}; "
                           "run scripts/vllm-env.sh")
    subprocess.run([interpreter, str(Path(__file__).resolve()), "--weights-only", str(out)], check=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL)
    return out / WEIGHTS_FILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="model directory to write (created if missing)")
    parser.add_argument("--with-weights", action="store_true",
                        help=f"also write a random-weight {WEIGHTS_FILE} (seed {WEIGHTS_SEED}); needs torch "
                             "(uses .cache/vllm-venv when this Python has none)")
    parser.add_argument("--python", default=None, help="Python with torch to make the weights with")


def run(args: argparse.Namespace) -> int:
    out: Path = args.dir
    for path in write_model(out):
        print(path)
    if args.with_weights:
        print(make_weights(out, args.python))
    return 0


def _weights_only_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="write only the random-weight checkpoint")
    parser.add_argument("--weights-only", type=Path, required=True)
    args = parser.parse_args(argv)
    print(write_weights(args.weights_only))
    return 0


if __name__ == "__main__":
    sys.exit(_weights_only_main(sys.argv[1:]))
