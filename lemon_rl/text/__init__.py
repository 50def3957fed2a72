"""Text: tokenizers (byte-level default, Hugging Face ``tokenizer.json``) and chat templates."""

from lemon_rl.text.chat_template import ChatTemplate
from lemon_rl.text.decoding import decode_completion
from lemon_rl.text.decoding import encode_prompt
from lemon_rl.text.tokenizers import ByteTokenizer
from lemon_rl.text.tokenizers import DEFAULT_EXTRA_SPECIAL_TOKENS
from lemon_rl.text.tokenizers import HFTokenizer
from lemon_rl.text.tokenizers import load_tokenizer
from lemon_rl.text.tokenizers import Tokenizer

__all__ = ["ByteTokenizer", "ChatTemplate", "DEFAULT_EXTRA_SPECIAL_TOKENS", "HFTokenizer", "Tokenizer",
           "decode_completion", "encode_prompt", "load_tokenizer"]
