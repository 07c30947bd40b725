"""Write a byte-level tokenizer for tests/agent/vllm/tiny-llama into a folder (a load generator such as
guidellm sends text, so the server needs a tokenizer; the repo holds only the model's config.json).

Vocabulary: <unk>=0, <s>=1, </s>=2, then one token per byte (GPT-2's byte-to-character map, no merges), so
ASCII text is one token per character and decoding is exact: a load generator that encodes, cuts to N tokens
and decodes (guidellm does) sends a text the server encodes to the same N tokens, and different texts stay
different (no accidental prefix-cache hits). Run with a python that has `tokenizers` and `transformers` (the
vLLM venv): python make_tokenizer.py OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def main(out: str) -> None:
    here = Path(__file__).resolve().parent / "tiny-llama"
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(here / "config.json", dst / "config.json")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in pre_tokenizers.ByteLevel.alphabet():  # the 256 characters that stand for the bytes
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 2048
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))


if __name__ == "__main__":
    main(sys.argv[1])
