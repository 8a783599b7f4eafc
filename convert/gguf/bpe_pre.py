"""``tokenizer.ggml.pre`` of a byte-level BPE tokenizer, chosen exactly as llama.cpp chooses it.

llama.cpp's converter (``TextModel.get_vocab_base_pre``) cannot read a pre-tokenizer's regular
expressions; it tokenizes a fixed check text with the model's own tokenizer (transformers'
``AutoTokenizer(...).encode``, special tokens included), takes the sha256 of ``str(ids)`` and looks the
hash up in a table of known tokenizers (:data:`convert.gguf.bpe_table.PRE_BY_HASH`); an unknown hash
stops the conversion. This module does the same with the ``tokenizers`` package (the Rust library under
transformers' fast tokenizers; no torch) on ``tokenizer.json``:

- :data:`CHECK_TEXT`: the text llama.cpp tokenizes (``chktxt``);
- :func:`check_hash`: sha256 of the ids, as ``get_vocab_base_pre`` computes it;
- :func:`bpe_pre`: the hash looked up in the table.

``tokenizers`` is an optional dependency (``pip install 'convert-bnb[gguf-bpe]'``): only a GGUF with a
byte-level BPE vocabulary needs it.

Rules raised here (see docs/errors.md):

========  ======================================================================================
GGUF-009  the tokenizer's check hash is one llama.cpp knows (:class:`UnknownBpePreTokenizerError`)
GGUF-010  the ``tokenizers`` package is installed for a byte-level BPE vocabulary
          (:class:`MissingTokenizersError`)
========  ======================================================================================
"""

from __future__ import annotations

from hashlib import sha256
from pathlib import Path
from typing import Any

from convert.gguf.bpe_table import PRE_BY_HASH
from formats.errors import MissingTokenizersError, TokenizerError, UnknownBpePreTokenizerError

__all__ = ["CHECK_TEXT", "PRE_BY_HASH", "bpe_pre", "check_hash"]

#: The text ``get_vocab_base_pre`` tokenizes: whitespace runs, emoji (with zero-width joiners),
#: digit runs, Khmer, Chinese, Cyrillic, repeated punctuation and English contractions in mixed case.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n"
    "\U0001f680 (normal) \U0001f636\u200d\U0001f32b\ufe0f (multiple emojis concatenated) \u2705 "
    "\U0001f999\U0001f999 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "\u1780\u17b6\u1793\u17cb\u178f\u17c2\u1796\u17b7\u179f\u17c1\u179f\u17a2\u17b6\u1785\U0001f601 "
    "?\u6211\u60f3\u5728apple\u5de5\u4f5c1314151\u5929\uff5e ------======= "
    "\u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438 "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? "
    "'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


def _tokenizers() -> Any:
    try:
        # (optional: the [gguf-bpe] extra)
        import tokenizers
    except ImportError:
        return None
    return tokenizers


def check_hash(tokenizer_json: Path) -> str:
    """sha256 of ``str(ids)`` for :data:`CHECK_TEXT` (``get_vocab_base_pre``'s ``chkhsh``).

    The ids are the tokenizer's own, special tokens added by its post-processor as transformers'
    ``encode`` adds them.

    Raises:
        MissingTokenizersError: GGUF-010 (the ``tokenizers`` package is not installed).
        TokenizerError: GGUF-004 (``tokenizers`` cannot load the file or tokenize with it).
    """
    lib = _tokenizers()
    if lib is None:
        raise MissingTokenizersError(
            "a byte-level BPE tokenizer needs the 'tokenizers' package for GGUF output",
            path=tokenizer_json,
            expected="the tokenizers package (pip install 'convert-bnb[gguf-bpe]', or pip install tokenizers)",
            found="not installed",
            action="convert",
        )
    try:
        tok = lib.Tokenizer.from_file(str(tokenizer_json))
        ids = tok.encode(CHECK_TEXT, add_special_tokens=True).ids
    except Exception as e:  # the Rust library raises a bare Exception for a file it cannot use
        raise TokenizerError(
            "the tokenizers package cannot load tokenizer.json (nor could transformers, which llama.cpp uses)",
            path=tokenizer_json,
            expected="a tokenizer.json that tokenizers.Tokenizer.from_file reads",
            found=f"{type(e).__name__}: {str(e)[:120]}",
            action="convert",
        ) from None
    return sha256(str(list(ids)).encode()).hexdigest()


def bpe_pre(tokenizer_json: Path) -> str:
    """``tokenizer.ggml.pre`` for a byte-level BPE ``tokenizer.json`` (``get_vocab_base_pre``).

    Raises:
        MissingTokenizersError: GGUF-010.
        TokenizerError: GGUF-004 (a file ``tokenizers`` cannot load).
        UnknownBpePreTokenizerError: GGUF-009 (a hash llama.cpp's table does not hold: no name is guessed).
    """
    digest = check_hash(tokenizer_json)
    name = PRE_BY_HASH.get(digest)
    if name is None:
        known = sorted(set(PRE_BY_HASH.values()))
        raise UnknownBpePreTokenizerError(
            "llama.cpp does not know this BPE pre-tokenizer (its check text's token ids hash to no known name)",
            path=tokenizer_json,
            expected=f"the hash of a tokenizer llama.cpp knows ({len(PRE_BY_HASH)} hashes of {len(known)} kinds)",
            found=f"chkhsh {digest}",
            hint=f"known kinds: {', '.join(known)}",
            action="convert",
        )
    return name
