"""`kvgate make-model`: the tiny model directory is complete, consistent and byte-for-byte deterministic."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tokenizers import Tokenizer

from bench import make_model
from tests.conftest import kvgate_command


def test_make_model_is_deterministic_and_consistent(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    subprocess.run(kvgate_command("make-model", str(a)), check=True, env=subprocess_env, timeout=60,
                   capture_output=True)
    make_model.write_model(b)
    names = sorted(p.name for p in a.iterdir())
    assert names == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (128, 2, 2)
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"] == 4096
    tcfg = json.loads((a / "tokenizer_config.json").read_text())
    for field in ("bos_token", "eos_token", "pad_token"):
        assert tok.token_to_id(tcfg[field]) is not None
    assert tok.token_to_id(tcfg["bos_token"]) == config["bos_token_id"]
    assert tok.token_to_id(tcfg["eos_token"]) == config["eos_token_id"]
    assert "<|im_start|>" in tcfg["chat_template"]

    text = "import os\nprint(os.getcwd())  # héllo"
    enc = tok.encode(text)
    assert enc.ids[0] == config["bos_token_id"]  # the post-processor adds BOS for text prompts
    assert len(enc.ids) < 0.6 * len(text)  # a trained BPE, not bytes
    assert tok.decode(enc.ids) == text
    # special tokens in text are single ids
    assert tok.encode("<|im_start|>user", add_special_tokens=False).ids[0] == tok.token_to_id("<|im_start|>")
