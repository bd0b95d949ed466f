"""Make the vLLM tests' model offline: a tiny Llama with random weights and a tokenizer trained
on the standard library's own source, the same bytes every run.

Run in the vLLM venv (``scripts/install-vllm.sh``): ``python make_model.py OUT``. Writes
``config.json``, ``model.safetensors`` and the tokenizer's files into OUT (created; must not
exist). No network: the tokenizer learns a byte-level BPE of 2048 tokens from a fixed, sorted
list of ``.py`` files of the interpreter's standard library, and the weights are drawn under a
fixed torch seed. ``initializer_range=0.2`` makes greedy output depend on the prompt.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 2048
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Enough text for 2048 merges; names, not a glob, so that the set never changes.
_SOURCES = [
    "argparse.py",
    "ast.py",
    "base64.py",
    "calendar.py",
    "collections/__init__.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "glob.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "json/encoder.py",
    "logging/__init__.py",
    "os.py",
    "pathlib.py",
    "pickle.py",
    "pprint.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "uuid.py",
    "zipfile.py",
]


def main(out: Path) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p for name in _SOURCES if (p := stdlib / name).is_file()]
    if len(texts) < 20:
        raise SystemExit(f"make_model: too few standard library sources under {stdlib}")

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in texts], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
